"""Device-name parsing: the spellings tf.distribute accepts, and clear errors for the rest."""

import pytest

from cudist._devices import canonicalize, parse_device

CPU1 = "/job:localhost/replica:0/task:0/device:CPU:1"


@pytest.mark.parametrize(
    "spelling",
    ["/cpu:1", "CPU:1", "cpu:1", "/device:CPU:1", "device:cpu:1", CPU1, "/job:localhost/device:CPU:1",
     "/replica:0/task:0/device:CPU:1", "/task:0/device:CPU:1", " /CPU:1 "],
)
def test_spellings_parse_to_the_canonical_name(spelling):
    assert canonicalize(spelling) == CPU1


def test_index_defaults_to_zero():
    assert parse_device("gpu").device_index == 0 and parse_device("gpu").is_gpu


@pytest.mark.parametrize("bad", ["/job:worker/device:CPU:0", "/replica:1/device:CPU:0", "/task:3/device:CPU:0",
                                 "/tpu:0", "cpu:x", "", "/device:CPU:0/extra"])
def test_other_jobs_tasks_and_types_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="invalid device"):
        parse_device(bad)


def test_non_string_is_a_type_error():
    with pytest.raises(TypeError, match="device must be a string"):
        parse_device(3)
