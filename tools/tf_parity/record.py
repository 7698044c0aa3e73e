"""Records TensorFlow 2.21's answers to the scenarios of ``multi_worker.py`` and ``documents.py`` (issue #31).

Run it with a Python that has TensorFlow 2.21 (cudist's tests never import it)::

    /path/to/tf-venv/bin/python tools/tf_parity/record.py              # both
    /path/to/tf-venv/bin/python tools/tf_parity/record.py documents    # one of multi_worker, documents

``documents``: runs ``documents.py --backend tf`` (the documents' loops on two logical CPUs) and writes
``tests/data/tf_documents.json``, which ``tests/test_tf_documents.py`` compares with the cudist ports.

``multi_worker``:
It starts two workers of ``multi_worker.py --backend tf`` on loopback, each with its own ``TF_CONFIG``
(a cluster of two ``worker`` tasks on free ports), one CPU each, waits for both (under a timeout) and
writes ``tests/data/tf_multi_worker.json``: TensorFlow's version and each process's answers, for
a cluster of two workers (every scenario) and one of a chief and a worker (device names).
``tests/test_tf_multi_worker.py`` runs the same scenarios under ``python -m cudist.launch -n 2
--tf-config`` and compares.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent.parent / "tests" / "data" / "tf_multi_worker.json"
#: The clusters of the ``multi_worker`` recording: two workers (every scenario), a chief and a worker
#: (the ``devices`` scenario: the chief's devices are named by its job).
CLUSTERS = {"workers": (["worker", "worker"], None), "chief": (["chief", "worker"], "devices")}
DOCUMENTS_OUT = HERE.parent.parent / "tests" / "data" / "tf_documents.json"
TIMEOUT = 300


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def record_documents():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "documents.json")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
        subprocess.run([sys.executable, str(HERE / "documents.py"), "--backend", "tf", "--out", str(out)],
                       env=env, check=True, timeout=TIMEOUT)
        documents = json.loads(out.read_text())
    import tensorflow as tf

    DOCUMENTS_OUT.write_text(json.dumps({"tensorflow": tf.__version__, **documents}, indent=1) + "\n")
    print(f"wrote {DOCUMENTS_OUT}")


def main():
    which = sys.argv[1:] or ["multi_worker", "documents"]
    if "documents" in which:
        record_documents()
    if "multi_worker" in which:
        record_multi_worker()


def record_multi_worker():
    import tensorflow as tf

    data = {"tensorflow": tf.__version__}
    for key, (jobs, scenarios) in CLUSTERS.items():
        data[key] = run_cluster(jobs, scenarios)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


def run_cluster(jobs, scenarios):
    """Each process's answers (chief first), one TF process per entry of ``jobs`` ("chief", "worker")."""
    ports = iter(_free_ports(len(jobs)))
    cluster = {}
    tasks = []
    for job in jobs:
        tasks.append({"type": job, "index": len(cluster.get(job, []))})
        cluster.setdefault(job, []).append(f"localhost:{next(ports)}")
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for task in tasks:
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": task}),
                       TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
            cmd = [sys.executable, str(HERE / "multi_worker.py"), "--backend", "tf", "--out", f"{tmp}/w{{rank}}.json"]
            if scenarios:
                cmd += ["--scenarios", scenarios]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"the TF workers ended with {codes}")
        return [json.loads(Path(tmp, f"w{i}.json").read_text()) for i in range(len(jobs))]


if __name__ == "__main__":
    main()
