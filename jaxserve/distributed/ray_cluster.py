"""The Ray cluster a command runs on: an existing one (`--ray-address`), or a local one started
on demand and stopped when the command ends."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("jaxserve.distributed")


def import_ray():
    """`ray`, or a ValueError that says how to install it (the [ray] extra)."""
    try:
        import ray
    except ImportError:
        raise ValueError("this needs Ray: pip install 'jaxserve[ray]' (or "
                         "'ray[serve]>=2.50')") from None
    return ray


class RayCluster:
    """`with RayCluster(address):` connects (address given, or RAY_ADDRESS set) or starts a
    local cluster; on exit it disconnects, which stops a cluster it started itself. `local`:
    whether the cluster is one this command started (a single node), False when joined or when
    the caller had connected already."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        self.address = address
        self.num_cpus = num_cpus
        self.started_here = False
        self.local = False

    def __enter__(self) -> "RayCluster":
        ray = import_ray()
        if ray.is_initialized():  # the caller owns the connection (a test, a notebook)
            return self
        joining = self.address is not None or bool(os.environ.get("RAY_ADDRESS"))
        kwargs = {"address": self.address} if self.address is not None else {}
        if not joining:
            # A local cluster for this command alone: no dashboard, and its workers inherit
            # this process's environment (JAX_PLATFORMS, XLA_FLAGS, PYTHONPATH).
            kwargs.update(include_dashboard=False, num_cpus=self.num_cpus)
        ray.init(**kwargs, log_to_driver=True, configure_logging=False)
        self.started_here = True
        self.local = not joining
        log.info("%s Ray cluster (%s CPUs)", "joined" if joining else "started a local",
                 ray.cluster_resources().get("CPU"))
        return self

    def __exit__(self, *exc) -> None:
        if self.started_here:
            import_ray().shutdown()
