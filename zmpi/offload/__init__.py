"""ZeRO-Infinity's NVMe tier (Rajbhandari et al., SC'21): what zmpi keeps on a drive.

    aio.py    AsyncIO: pread/pwrite requests on threads, `queue_depth` in flight (the
              config's `aio` section)
    files.py  SwapFile: a rank's file, reserved whole, O_DIRECT where allowed, removed on
              close; the 4 KiB-aligned host buffers of direct I/O
    nvme.py   NvmeOptimizerState: a rank's master weights and Adam moments in a file,
              streamed block by block through a bounded pool of host buffers, with read-ahead
              and write-behind; SwappedState, the handle a strategy keeps for each state
    nvme_param.py  NvmeParamShard: stage 3's parameter shard in a file, a unit read into a
              pooled host buffer when its gather starts, the updated shard written behind

A strategy holds an NvmeOptimizerState as `strategy.nvme` when `offload_optimizer.device` is
"nvme", an NvmeParamShard as `strategy.param_store` when `offload_param.device` is "nvme"
(zmpi.zero.strategy); docs/offload.md describes the keys and the figures.
"""
from zmpi.offload.aio import AsyncIO
from zmpi.offload.nvme import NVMeError, NvmeOptimizerState, SwappedState
from zmpi.offload.nvme_param import NvmeParamShard

__all__ = ["AsyncIO", "NVMeError", "NvmeOptimizerState", "NvmeParamShard", "SwappedState"]
