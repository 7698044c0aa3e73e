"""``cudist.experimental``: names tf.distribute keeps under ``experimental``."""

from cudist._central_storage_strategy import CentralStorageStrategy

__all__ = ["CentralStorageStrategy"]
