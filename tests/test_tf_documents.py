"""TensorFlow's documents' loops ported to cudist, against TF 2.21's recorded outputs (issue #31).

``tools/tf_parity/documents.py`` holds the Distributed input tutorial's snippets, the Strategy API page's examples and the Distributed
training guide's custom loop, written once for both libraries with the porting guide's renames;
``tools/tf_parity/record.py documents`` ran them on TF 2.21 (two logical CPUs) into
``tests/data/tf_documents.json``. Here they run on cudist, in this process: the input tutorial's
answers must be equal, the training loop's losses and weights equal to float32 rounding (TF's
gradients come from its tape, cudist's port writes them out). The multi-worker custom-training-loop
tutorial's loop is the ``ctl`` scenario of ``tests/test_tf_multi_worker.py``. TF is never imported.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDED = json.loads((ROOT / "tests" / "data" / "tf_documents.json").read_text())


@pytest.fixture(scope="module")
def ported():
    spec = importlib.util.spec_from_file_location("tf_parity_documents", ROOT / "tools" / "tf_parity" / "documents.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run("cudist")


def test_the_recording_is_tf_2_21():
    assert RECORDED["tensorflow"] == "2.21.0"
    # The tutorial's own prose, as TF printed it: a partial last step gives the second replica an empty batch.
    assert RECORDED["input_tutorial"]["get_next_as_optional"][-1] == [[8], []]
    assert RECORDED["input_tutorial"]["range(6).batch(4)"] == [[[0, 1], [2, 3]], [[4], [5]]]


@pytest.mark.parametrize("key", sorted(RECORDED["input_tutorial"]))
def test_input_tutorial_port_equals_tf(ported, key):
    assert ported["input_tutorial"][key] == RECORDED["input_tutorial"][key]


def test_guide_custom_loop_port_equals_tf(ported):
    want, got = RECORDED["guide_custom_loop"], ported["guide_custom_loop"]
    assert len(got["losses"]) == len(want["losses"]) == 100  # 1000 examples, global batch 10
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
    np.testing.assert_allclose(got["kernel"], want["kernel"], rtol=1e-6)
    np.testing.assert_allclose(got["bias"], want["bias"], rtol=1e-6)
    assert got["losses"][-1] < got["losses"][0] / 10  # it trains


@pytest.mark.parametrize("key", sorted(RECORDED["strategy_api"]))
def test_strategy_api_page_port_equals_tf(ported, key):
    """The ``tf.distribute.Strategy`` API page's examples, ported (tools/tf_parity/documents.py)."""
    assert ported["strategy_api"][key] == RECORDED["strategy_api"][key]


def test_strategy_api_page_recording_is_the_page():
    # What the page prints, on two replicas: replica ids summed, a constant doubled on each replica,
    # range(4).batch(2) doubled, the gathers' shapes (2, 1) -> (4, 1) and (1, 2, 3) -> (2, 2, 3) / (1, 4, 3) / (1, 2, 6).
    page = RECORDED["strategy_api"]
    assert page["reduce"] == 1 and page["run_tensor_input"] == [6.0, 6.0] and page["run_all_reduce"] == [1, 1]
    assert page["experimental_distribute_dataset"] == [[[0], [2]], [[4], [6]]]
    assert [np.shape(g) for g in page["gather_axes"]] == [(2, 2, 3), (1, 4, 3), (1, 2, 6)]
