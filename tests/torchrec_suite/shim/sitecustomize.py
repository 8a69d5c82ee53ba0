# Multi-process DMP tests start their ranks with forkserver/spawn: give those processes
# the same aliases (IBP_TRSHIM_ALIASES=1) and IBP patches (IBP_TRSHIM=1) as the parent.
# conftest.py sets both variables; PYTHONPATH must contain this directory.
import os

if os.environ.get("IBP_TRSHIM_ALIASES") == "1":
    import ibp_trshim

    ibp_trshim.install_aliases()
    if os.environ.get("IBP_TRSHIM") == "1":
        ibp_trshim.install_dmp()
