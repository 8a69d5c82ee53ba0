"""DLRM / DCN training on IBP-compressed embedding tables, next to TorchRec's fused FBGEMM tables.

    python -m dlrm_example.train --backend ibp|torchrec [options]   # train / eval / resume
    python -c "import dlrm_example.demo as d; d.main()"             # short demo of both backends

Modules: data (Criteo-like generator, Criteo TSV and TorchRec .npy readers), model
(tables, DLRM / DLRM_DCN, both backends), checkpoint (atomic .ibp checkpoints), train
(the trainer CLI), demo.
"""
import os as _os

# torch and libibp each bring an OpenMP runtime; with the default (active) wait policy
# their idle workers spin against each other, and on a machine with few (or busy) cores
# a training step got 10-100x slower (measured: 0.4 s -> 47 s for 15 steps on 2 shared
# cores). Passive waiting avoids that; it only takes effect when set before torch loads,
# i.e. for `python -m dlrm_example.*`. An explicit OMP_WAIT_POLICY is respected.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
