"""vLLM's CPU offloading on vLLM's CPU build, for ``tests/real/test_offload_vs_vllm.py``.

This module runs inside vLLM's own processes (its virtual environment, with torch), never
in the repository's: the engine imports it by name, with this directory on its
``PYTHONPATH``, through the offloading connector's out-of-tree spec hook
(``v1/kv_offload/factory.py``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": N,
        "spec_name": "HostCPUOffloadingSpec", "spec_module_path": "host_offload_spec"}}'

vLLM 0.32's ``CPUOffloadingSpec`` refuses any platform but CUDA-alike and XPU GPUs in
``get_worker`` (``v1/kv_offload/cpu/spec.py:197-203``), and its worker copies with CUDA
streams and events. This subclass keeps every part that decides and tells as vLLM has it
(the scheduler-side ``CPUOffloadingManager``: lookups, its LRU, loads and stores, the KV
events and metrics) and replaces only the worker, by a synchronous copy of whole block
pages between the engine's KV tensors and a host buffer.

Limits: one engine block per offloaded chunk (``blocks_per_chunk`` 1, the default), one
worker rank.
"""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

# Under vLLM's logger, which its processes configure.
logger = init_logger("vllm.kvrouter.host_offload_spec")


class SyncHostWorker(OffloadingWorker):
    """Copies a job's block pages when it is submitted; ``get_finished`` reports it at the
    next poll, as a copy that ended in between."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        self.group_refs = kv_caches.group_data_refs
        # Each tensor seen as one row of bytes a block, as its page size says.
        self.engine = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self.host = [
            torch.zeros((num_chunks, t.page_size_bytes), dtype=torch.int8)
            for t in kv_caches.tensors
        ]
        self.done: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy ended when it was submitted

    def _copy(
        self, job_id: int, engine_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"a host block list was expected, not {host_spec!r}")
        start = time.perf_counter()
        engine_ids = torch.from_numpy(engine_spec.block_ids.astype("int64"))
        host_ids = torch.from_numpy(host_spec.block_ids.astype("int64"))
        if len(engine_ids) != len(host_ids):
            raise ValueError("one engine block per offloaded chunk only")
        offset, moved = 0, 0
        for group, size in enumerate(engine_spec.group_sizes):
            rows = slice(offset, offset + size)
            offset += size
            for ref in self.group_refs[group]:
                engine, host = self.engine[ref.tensor_idx], self.host[ref.tensor_idx]
                n = ref.page_size_bytes  # a layer's share of the (maybe padded) page
                if to_host:
                    host[host_ids[rows], :n] = engine[engine_ids[rows], :n]
                else:
                    engine[engine_ids[rows], :n] = host[host_ids[rows], :n]
                moved += size * n
        self.done.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True


class HostCPUOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with a worker that runs on the CPU platform."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._host_worker: SyncHostWorker | None = None
        # The test reads this line to know the tier's size in blocks.
        logger.info(
            "HostCPUOffloadingSpec: offload tier of %d chunks of %d bytes (blocks_per_chunk=%d)",
            self.num_chunks,
            self.kv_bytes_per_chunk,
            self.blocks_per_chunk,
        )

    def _uses_shared_region(self) -> bool:
        return False  # a private host tensor, as on platforms without the mmap region

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.blocks_per_chunk != 1:
            raise ValueError("HostCPUOffloadingSpec offloads one engine block per chunk")
        if self._host_worker is None:
            self._host_worker = SyncHostWorker(kv_caches, self.num_chunks)
        return self._host_worker
