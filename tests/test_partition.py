"""Cutting tensors into partitions and placing them on servers (pure functions)."""
from __future__ import annotations

import random

import pytest

from bpsctl.engine.partition import MIN_PIECE_BYTES, Partition, Placement, piece_bytes, split

ITEMSIZES = [1, 2, 4, 8]


def assert_covers_exactly(pieces: list[tuple[int, int]], nbytes: int) -> None:
    offset = 0
    for start, length in pieces:
        assert start == offset, f"gap or overlap at byte {offset}: {pieces}"
        offset += length
    assert offset == nbytes


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("partition_bytes", [8, 9, 10, 1000, 4096, 4096000])
@pytest.mark.parametrize("elements", [1, 2, 3, 7, 125, 1000, 4097, 20_011])
def test_pieces_cover_the_tensor_on_element_boundaries(itemsize, partition_bytes, elements):
    nbytes = elements * itemsize
    pieces = split(nbytes, itemsize, partition_bytes)
    assert_covers_exactly(pieces, nbytes)
    for offset, length in pieces:
        assert offset % itemsize == 0 and length % itemsize == 0
        assert 0 < length <= partition_bytes
    # as few pieces as element-aligned pieces of at most partition_bytes allow
    per_piece = partition_bytes // itemsize * itemsize
    assert len(pieces) == -(-nbytes // per_piece)


def test_examples():
    assert split(10, 1, 4) == [(0, 4), (4, 4), (8, 2)]
    assert split(24, 8, 20) == [(0, 16), (16, 8)]          # 20 is cut down to whole elements
    assert split(8, 4, 4096000) == [(0, 8)]


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_a_zero_byte_tensor_gets_one_empty_piece(itemsize):
    assert split(0, itemsize, 4096) == [(0, 0)]
    parts = Placement(3).place(0, itemsize, 4096)
    assert parts == [Partition(part_id=0, server=0, offset=0, length=0)]


def test_placement_numbers_partitions_job_wide_and_keeps_their_pieces():
    placement = Placement(3)
    first = placement.place(1000, 4, 400)
    second = placement.place(24, 8, 400)
    assert [p.part_id for p in first + second] == list(range(len(first) + len(second)))
    assert [(p.offset, p.length) for p in first] == split(1000, 4, 400)
    assert [(p.offset, p.length) for p in second] == split(24, 8, 400)
    assert all(0 <= p.server < 3 for p in first + second)


def server_bytes(parts: list[Partition], num_servers: int) -> list[int]:
    loads = [0] * num_servers
    for part in parts:
        loads[part.server] += part.length
    return loads


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", range(3))
def test_servers_carry_bytes_within_one_partition_of_each_other(num_servers, seed):
    rng = random.Random(seed)
    partition_bytes = rng.choice([256, 1000, 4096])
    placement, parts = Placement(num_servers), []
    for _ in range(100):                                  # a model's worth of tensors
        itemsize = rng.choice(ITEMSIZES)
        parts += placement.place(rng.randint(0, 5000) * itemsize, itemsize, partition_bytes)
    loads = server_bytes(parts, num_servers)
    assert max(loads) - min(loads) <= partition_bytes, loads
    assert sum(loads) == sum(p.length for p in parts)


def test_a_big_tensor_is_spread_over_every_server():
    parts = Placement(4).place(100 * 4096, 4, 4096)
    assert server_bytes(parts, 4) == [25 * 4096] * 4


def test_many_small_tensors_are_spread_too():
    placement = Placement(3)
    parts = [p for _ in range(30) for p in placement.place(4, 4, 4096)]
    assert [p.server for p in parts] == [0, 1, 2] * 10


def test_placement_is_deterministic():
    def plan(num_servers: int) -> list[Partition]:
        placement = Placement(num_servers)
        return [p for size in (4000, 12, 0, 99_999 * 4, 8, 65_536)
                for p in placement.place(size, 4, 4096)]
    assert plan(3) == plan(3)
    assert plan(4) == plan(4)
    assert plan(3) != plan(4)


def test_a_placement_needs_a_server():
    with pytest.raises(ValueError, match="at least one server"):
        Placement(0)


def test_a_lost_servers_partitions_move_to_the_least_loaded_survivors_and_stay_off_it():
    placement = Placement(3)
    parts = [[p.part_id, p.server, p.offset, p.length] for p in placement.place(600, 4, 100)]
    on_lost = sorted(p[0] for p in parts if p[1] == 1)
    moves = placement.move_off(1, parts)
    assert sorted(part_id for part_id, _ in moves) == on_lost
    assert all(p[1] in (0, 2) for p in parts)
    assert placement.loads[0] == placement.loads[2] == 300       # balanced again
    assert all(p.server != 1 for p in placement.place(1000, 4, 100))
    placement.move_off(0, parts)
    with pytest.raises(ValueError, match="every server of the job is lost"):
        placement.move_off(2, parts)        # the scheduler fails the job instead


def test_a_spare_gets_nothing_until_it_takes_over_all_of_a_lost_servers_partitions():
    placement = Placement(4, spare={2, 3})
    parts = [[p.part_id, p.server, p.offset, p.length] for p in placement.place(800, 4, 100)]
    assert {p[1] for p in parts} == {0, 1}
    on_lost = sorted(p[0] for p in parts if p[1] == 0)
    moves = placement.move_off(0, parts, to=2)
    assert moves == [[part_id, 2] for part_id in on_lost]
    assert placement.loads[1] == placement.loads[2] == 400       # as balanced as before
    assert placement.spare == {3}
    assert {p.server for p in placement.place(800, 4, 100)} == {1, 2}   # 2 is a server now
    assert placement.move_off(3, parts) == [] and placement.spare == set()   # a spare lost


def test_partition_depth_cuts_a_large_tensor_so_every_server_gets_that_many_pieces():
    mib = 1 << 20
    # 64 MiB over 4 servers at depth 16: 1 MiB pieces, 16 on each server
    placement = Placement(4)
    parts = placement.place(64 * mib, 4, 2 * mib, depth=16)
    assert {p.length for p in parts} == {mib}
    assert [sum(p.server == s for p in parts) for s in range(4)] == [16] * 4
    # never above partition_bytes (a huge tensor keeps them), never below 1 MiB (a small one)
    assert piece_bytes(4096 * mib, 4, 2 * mib, 16) == 2 * mib
    assert piece_bytes(4 * mib, 4, 2 * mib, 16) == MIN_PIECE_BYTES
    # a partition_bytes already below the floor is kept; depth 0 is off
    assert piece_bytes(64 * mib, 4, 4096, 16) == 4096
    assert piece_bytes(64 * mib, 4, 2 * mib, 0) == 2 * mib


def test_partition_depth_counts_only_the_servers_that_take_partitions():
    placement = Placement(4, spare={3})
    parts = placement.place(96 * (1 << 20), 4, 4 << 20, depth=16)
    assert {p.length for p in parts} == {2 << 20}           # 96 MiB / (3 servers x 16)
    assert {p.server for p in parts} == {0, 1, 2}


# --------------------------------------------------------------------------- shares

def _targets(placement: Placement, shares: list[float]) -> list[float]:
    """Each serving server's share of the bytes placed on the serving servers."""
    serving = placement.serving()
    total = sum(placement.loads[s] for s in serving)
    weight = sum(shares[s] for s in serving)
    return [shares[s] / weight * total if s in serving else 0.0 for s in range(len(shares))]


def _place_mix(placement: Placement, rng: random.Random, tensors: int) -> list[Partition]:
    partition_bytes = rng.choice([256, 1000, 4096, 65536])
    depth = rng.choice([0, 0, 4, 16])
    parts = []
    for _ in range(tensors):
        itemsize = rng.choice(ITEMSIZES)
        elements = rng.choice([0, 1, rng.randint(1, 5000), rng.randint(1, 50_000)]) \
            * partition_bytes // 4096
        parts += placement.place(elements * itemsize, itemsize, partition_bytes, depth)
    return parts


@pytest.mark.parametrize("seed", range(30))
def test_each_server_carries_its_share_within_one_partition_for_any_mix_of_tensors(seed):
    rng = random.Random(seed)
    servers = rng.randint(1, 8)
    shares = [rng.choice([0.0, 0.05, 0.1, 0.3, 1.0, rng.random()]) for _ in range(servers)]
    if not any(shares):
        shares[rng.randrange(servers)] = 0.5
    placement = Placement(servers, shares=shares)
    parts = _place_mix(placement, rng, rng.randint(1, 120))
    loads = server_bytes(parts, servers)
    biggest = max(p.length for p in parts) or 1
    for load, target in zip(loads, _targets(placement, shares), strict=True):
        assert abs(load - target) <= biggest, (shares, loads, biggest)
    assert all(load == 0 for load, share in zip(loads, shares, strict=True) if share == 0)


def test_bytepss_layout_of_4_worker_hosts_and_2_cpu_hosts_is_met_piece_by_piece():
    # 64 MiB in 8 tensors at depth 16 over 6 servers: 1 MiB pieces, 64 of them; the CPU hosts'
    # servers sum 0.3 each (19.2 pieces), the worker hosts' 0.1 (6.4)
    mib = 1 << 20
    placement = Placement(6, shares=[0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    parts = [p for _ in range(8) for p in placement.place(8 * mib, 4, 2 * mib, depth=16)]
    assert sorted(server_bytes(parts, 6)) == [6 * mib, 6 * mib, 7 * mib, 7 * mib,
                                              19 * mib, 19 * mib]


def test_equal_shares_place_exactly_as_the_even_split():
    rng, even_rng = random.Random(7), random.Random(7)
    even, weighted = Placement(5), Placement(5, shares=[0.2] * 5)
    assert _place_mix(even, even_rng, 60) == _place_mix(weighted, rng, 60)


def test_a_share_of_1_takes_everything_and_shares_of_0_nothing():
    placement = Placement(3, shares=[0.0, 1.0, 0.0])
    parts = placement.place(100 * 4096, 4, 4096) + placement.place(8, 4, 4096)
    assert {p.server for p in parts} == {1}
    # all shares 0: nothing to go by, so the servers share evenly rather than fail
    assert server_bytes(Placement(2, shares=[0, 0]).place(8 * 4096, 4, 4096), 2) == [
        4 * 4096, 4 * 4096]


def test_bad_shares_are_refused():
    for shares in ([0.5], [0.5, -0.1], [0.5, float("nan")], [0.5, float("inf")]):
        with pytest.raises(ValueError, match="shares"):
            Placement(2, shares=shares)


@pytest.mark.parametrize("seed", range(20))
def test_a_lost_servers_partitions_move_by_the_survivors_shares(seed):
    rng = random.Random(seed)
    servers = rng.randint(2, 7)
    shares = [rng.choice([0.1, 0.2, 0.3, rng.random() + 0.01]) for _ in range(servers)]
    placement = Placement(servers, shares=shares)
    parts = [[p.part_id, p.server, p.offset, p.length]
             for p in _place_mix(placement, rng, rng.randint(5, 80))]
    lost = rng.randrange(servers)
    on_lost = {p[0] for p in parts if p[1] == lost}
    moves = placement.move_off(lost, parts)
    assert {part_id for part_id, _ in moves} == on_lost
    assert all(p[1] != lost for p in parts)
    loads = [sum(max(p[3], 1) for p in parts if p[1] == s) for s in range(servers)]
    assert loads == placement.loads
    biggest = max(max(p[3], 1) for p in parts)
    for load, target in zip(loads, _targets(placement, shares), strict=True):
        # the moved partitions go, largest first, to whichever survivor is furthest below its
        # share of everything: each ends within one partition of it
        assert abs(load - target) <= biggest, (shares, lost, loads)
    later = server_bytes(placement.place(50 * 4096, 4, 4096), servers)
    assert later[lost] == 0


def test_when_the_only_server_with_a_share_is_lost_the_survivors_share_evenly():
    placement = Placement(3, shares=[0.0, 1.0, 0.0])
    parts = [[p.part_id, p.server, p.offset, p.length] for p in placement.place(800, 4, 100)]
    placement.move_off(1, parts)
    assert placement.loads[0] == placement.loads[2] == 400


def test_a_spare_that_takes_over_sums_the_lost_servers_share():
    placement = Placement(4, shares=[0.6, 0.2, 0.2, 0.0], spare={3})
    parts = [[p.part_id, p.server, p.offset, p.length] for p in placement.place(1000, 4, 10)]
    assert server_bytes([Partition(*p) for p in parts], 4) == [600, 200, 200, 0]
    placement.move_off(0, parts, to=3)
    assert placement.loads == [0, 200, 200, 600]          # the spare has the lost one's bytes
    more = server_bytes(placement.place(1000, 4, 10), 4)
    assert more == [0, 200, 200, 600]                      # ... and its share from now on
