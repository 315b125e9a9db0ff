"""`fleetmedic agent`: the GPU node agent (a DaemonSet, one per GPU node).

NVML (`nvml.py`) and InfiniBand sysfs (`infiniband.py`) readings become Prometheus metrics
(`metrics.py`) and the validation verdict the runbooks ask for (`validation.py`); `app.py`
serves them with the token-protected GPU reset.
"""
