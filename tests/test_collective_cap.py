"""--max-member-share over replicas (issue 29, item 9): each replica caps its members' FedAvg
weights against the whole round's counts, so every replica computes the weights one server
would (two gloo processes on loopback)."""
import json
import pytest

from forkserver import process_context

from splitlearn.procs.localserver import free_port
from splitlearn.server.federation.aggregate import capped_weights

pytestmark = pytest.mark.slow

ROUND = {0: [22, 960], 1: [22]}  # members' target tokens on replica 0 and replica 1


def _replica(rank: int, port: int, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from splitlearn.server.federation.collective import TorchCollective
    from splitlearn.server.federation.rounds import capped_over

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mine, total, capped = capped_over(TorchCollective(), 0.5, ROUND[rank])
        with open(out, "w") as f:
            json.dump({"mine": mine, "total": total, "capped": capped}, f)
    finally:
        dist.destroy_process_group()


def test_every_replica_caps_against_the_whole_round(tmp_path):
    port, ctx = free_port(), process_context()  # forked: torch imported
    procs = [ctx.Process(target=_replica, args=(r, port, str(tmp_path / f"{r}.json"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    one_server = capped_weights([*ROUND[0], *ROUND[1]], 0.5)  # what one server with all three computes
    assert got[0]["mine"] + got[1]["mine"] == one_server == [22.0, 44.0, 22.0]  # 960 lowered to half of 88
    assert got[0]["total"] == got[1]["total"] == sum(one_server)
    assert got[0]["capped"] == got[1]["capped"] == 1
