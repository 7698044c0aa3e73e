"""``cudist.experimental``: names tf.distribute keeps under ``experimental``."""

from cudist._central_storage_strategy import CentralStorageStrategy
from cudist._collective_all_reduce_strategy import MultiWorkerMirroredStrategy
from cudist._collective_util import CommunicationImplementation, CommunicationOptions
from cudist._input_lib import ValueContext

__all__ = [
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ValueContext",
]
