"""cuFile reads into device memory (NOTE [ cuFile reads ], NOTE [ Disk tier ] Rule 8, NOTE [ Snapshot disk tier ]
Rule 6) on a GPU machine whose cuFile opens (compatibility mode is enough): a file read into a CUDA buffer gives the
bytes written, and an adjoint through a CUDA store reads its disk snapshots straight into the slots, bit-exact."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ckpt_models import assert_bits_equal
from torchckpt import CheckpointError, SnapshotStore, run_schedule
from torchckpt.memory import DiskTier, HostPool, gds
from torchckpt.schedules import Revolve, Tier, ZCut

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def cufile_reads(tmp_path: Any) -> None:
    ok, why = gds.probe(str(tmp_path))
    if not ok:
        pytest.skip(f"cuFile cannot read here: {why}")


def test_where_cufile_cannot_read_true_raises_and_none_reads_through_host(tmp_path: Any) -> None:
    """NOTE [ cuFile reads ] Rule 2 on a machine whose cuFile opens its driver but registers no file of the directory
    (the H100 machine: virtio disk, no nvidia-fs): ``device_reads=True`` raises saying what to pass, ``None`` reads
    through host blocks, bit-exact."""
    ok, why = gds.probe(str(tmp_path))
    if ok:
        pytest.skip(f"cuFile reads files here ({why}): the tests below cover it")
    cuda = torch.device("cuda")
    with DiskTier(tmp_path, device_reads=True) as tier:
        with pytest.raises(CheckpointError, match=r"^torchckpt: DiskTier\(device_reads=True\), but cuFile cannot read "
                                                  r"here: .*; pass device_reads=None"):
            tier.reads_into(cuda)
    with DiskTier(tmp_path) as tier:
        assert not tier.reads_into(cuda)
    st = _adjoint(tmp_path, ZCut(60, segment=1, tier=Tier.DISK), None)  # every restore checked bit for bit
    # through host blocks: every byte read from the files was filled into the slots from host memory
    assert st.disk is not None and st.disk.reads > 0 and st.bytes_to_device >= st.disk.bytes_read


@pytest.mark.parametrize("direct", [False, None])
@pytest.mark.parametrize("nbytes", [1, 4096, 5105, (8 << 20) + 3])
@pytest.mark.usefixtures("cufile_reads")
def test_a_file_read_into_a_cuda_buffer_gives_its_bytes(tmp_path: Any, nbytes: int, direct: bool | None) -> None:
    g = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 255, (nbytes,), generator=g, dtype=torch.uint8)
    tier = DiskTier(tmp_path, direct=direct, device_reads=True)
    try:
        tier.write("a", src).result()
        out = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        fut = tier.prefetch("a", out)
        assert tier.read("a", out) is out and fut.done()
        assert torch.equal(out.cpu(), src)
        again = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        assert torch.equal(tier.read("a", again).cpu(), src)  # a read with no prefetch, on the caller's thread
    finally:
        tier.close()


@pytest.mark.parametrize("sched", [Revolve(60, 30, tier=Tier.DISK), ZCut(60, segment=1, tier=Tier.DISK)],
                         ids=["revolve", "zcut"])
@pytest.mark.usefixtures("cufile_reads")
def test_an_adjoint_reads_its_disk_snapshots_into_the_slots_bit_exact(tmp_path: Any, sched: Any) -> None:
    st = _adjoint(tmp_path, sched, True)
    # the prefetched reads went into the slots: fewer bytes filled from host blocks than were read from the files
    assert st.disk is not None and st.disk.reads > 0 and st.prefetches > 0 and st.bytes_to_device < st.disk.bytes_read


def _adjoint(tmp_path: Any, sched: Any, device_reads: bool | None) -> Any:
    """An adjoint of 60 steps through a CUDA store with a disk tier, each restore checked bit for bit; its stats."""
    n = 60
    g = torch.Generator(device="cuda").manual_seed(3)
    first = [torch.randn(64, 1000, device="cuda", generator=g), torch.randn(333, device="cuda", generator=g)]
    ref = [first]
    for k in range(1, n):
        ref.append([t * 0.75 + k for t in ref[-1]])
    state = [t.clone() for t in first]
    seen: list[int] = []

    def forward(n0: int, n1: int) -> None:
        for k in range(n0 + 1, n1 + 1):
            for t in state:
                t.mul_(0.75).add_(k)

    def backward(k: int) -> None:
        assert_bits_equal(state, ref[k])
        seen.append(k)

    tier = DiskTier(tmp_path, reads=4, device_reads=device_reads)
    host = HostPool(capacity_bytes=64 << 20, chunk_bytes=1 << 20, pin=True)
    with SnapshotStore("cuda", slots=4, host=host, disk=tier) as snaps:
        st = run_schedule(sched, forward=forward, save=lambda k: state, backward=backward, store=snaps, slots=4,
                          end_forward=tier.wait, restore_into=lambda k: state)
    assert seen == list(range(n - 1, -1, -1))
    tier.close()
    assert os.listdir(tmp_path) == []
    return st
