"""kiln.telemetry: device telemetry (memory, utilization, power, clocks, temperature and kiln's
own allocator figures) as dicts; docs/telemetry.md lists the fields and their units."""
import json

from . import _C


def sample(device="cpu"):
    """One reading of `device` ("cpu", "cuda:0", ...) as a dict: absent figures are None, and
    "notes" (when present) says why. Rates (CPU utilization, RAPL power) are averages since the
    previous sample of this process (the first waits 0.1 s)."""
    return json.loads(_C.telemetry_sample(str(device)))


def devices():
    """Every device this process can sample: "cpu", then "cuda:0" ... ."""
    return list(_C.telemetry_devices())
