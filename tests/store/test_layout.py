"""The store's layout: Store composed of one part per Redis structure or concern, each in its own documented module;
the one error mapping over every public method of every part; the store's one stream-id parser; a plan's hash
written and read in one place."""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest

from fdeplb.errors import CorruptRecordError, InputError, RedisUnavailableError
from fdeplb.store import PendingCall, PlanEntry, Store
from fdeplb.store.streams import parse_stream_id

PARTS = [k for k in Store.__mro__ if k not in (Store, object)]


def owner(name: str) -> type:
    """The part of Store whose definition of ``name`` Store resolves to."""
    return next(k for k in PARTS if name in vars(k))


def test_every_part_is_its_own_documented_module():
    modules = [sys.modules[k.__module__] for k in PARTS]
    assert len({m.__name__ for m in modules}) == len(PARTS)
    for part, module in zip(PARTS, modules):
        assert module.__name__.startswith("fdeplb.store.") and module.__doc__ and module.__doc__.strip(), part
        assert part.__doc__ and part.__doc__.strip(), part


def test_every_public_method_of_every_part_is_wrapped_in_the_error_mapping():
    public = {name for part in PARTS for name, value in vars(part).items()
              if not name.startswith("_") and inspect.isfunction(value)}
    assert len(public) >= 78  # as many as Store had before it was split
    for name in sorted(public):
        method = getattr(Store, name)
        assert getattr(method, "maps_redis_errors", False), f"{owner(name).__name__}.{name} is not wrapped"
        assert method.__wrapped__ is vars(owner(name))[name]  # the definition Store resolves to, wrapped once
    # and nothing public on Store escapes: whatever resolves on it is one of those
    assert {n for n, v in inspect.getmembers(Store, inspect.isfunction) if not n.startswith("_")} == public


#: one call per part that reaches Redis before anything else can fail
CALLS = [
    ("now_ms", ()), ("read_cluster", ()), ("request_clear_stat", ()), ("load_round", (0,)), ("has_plan", ("p",)),
    ("lease_info", ()), ("audit_length", ()), ("rank_agent", (0,)), ("key_count", ()), ("delete_cluster", ()),
    ("last_member_audit", (0,)),
    ("send", ([PendingCall("a read", lambda pipe: pipe.get("k"), lambda reply: reply)],)),
]


def test_the_calls_below_reach_every_part():
    assert {owner(name) for name, _ in CALLS} == set(PARTS)


@pytest.mark.parametrize("name,args", CALLS, ids=[name for name, _ in CALLS])
def test_a_connection_error_in_any_part_is_redis_unavailable(cluster_id, name, args):
    store = Store("redis://127.0.0.1:1/0", cluster_id)  # nothing listens on port 1: redis-py's ConnectionError
    with pytest.raises(RedisUnavailableError, match="unavailable"):
        getattr(store, name)(*args)


@pytest.mark.parametrize("text,expected", [
    ("0-0", (0, 0)), ("1700000000000-12", (1700000000000, 12)), ("007-01", (7, 1)),
    (f"{2**64 - 1}-{2**64 - 1}", (2**64 - 1, 2**64 - 1)),
])
def test_parse_stream_id_reads_ms_and_seq(text, expected):
    assert parse_stream_id(text) == expected


@pytest.mark.parametrize("text", [
    "", "5", "1-", "-1", "1-2-3", " 1-2", "1-2\n", "1_2", "+1-2", "1-+2", "\uff11-2", "1-\u0662",  # not ASCII digits
    f"{2**64}-0", f"0-{2**64}", "1" * 21 + "-0", "0x1-0", b"1-2", None, 12,
])
def test_parse_stream_id_refuses_anything_else(text):
    with pytest.raises(InputError, match="not a stream id"):
        parse_stream_id(text)


def plan() -> PlanEntry:
    return PlanEntry(plan_id="0123456789abcdef", round=3, policy="deepseek", old_plan_id="",
                     topology={"num_layers": 2, "ep_size": 2}, expert_load=np.arange(8).reshape(2, 4),
                     old_phy2log=np.array([[0, 1, 2, 3, 0, 1]] * 2), new_phy2log=np.array([[3, 2, 1, 0, 3, 2]] * 2),
                     balancedness_before=0.5, balancedness_after=0.9375, moved_experts=4)


def test_a_plan_comes_back_from_its_hash_fields():
    p = plan()
    fields = p.to_fields()
    assert fields["balancedness_before"] == "0.500000" and fields["topology"] == '{"ep_size": 2, "num_layers": 2}'
    as_read = {k: v.encode() if isinstance(v, str) else v for k, v in fields.items()}  # Redis replies are bytes
    back = PlanEntry.from_fields("k", as_read)
    for name in ("plan_id", "round", "policy", "old_plan_id", "topology", "balancedness_before",
                 "balancedness_after", "moved_experts"):
        assert getattr(back, name) == getattr(p, name), name
    for name in ("expert_load", "old_phy2log", "new_phy2log"):
        assert getattr(back, name).dtype == np.int64 and np.array_equal(getattr(back, name), getattr(p, name))
    del as_read["plan_id"]
    assert PlanEntry.from_fields("k", as_read, "given").plan_id == "given"


@pytest.mark.parametrize("change,message", [
    ({"new_phy2log": None}, "lacks new_phy2log"), ({"round": b"x"}, "invalid literal"),
    ({"topology": b"{"}, "property name"), ({"expert_load:dtype": b"|O"}, "refused"),
])
def test_a_corrupt_plan_hash_names_its_key(change, message):
    fields = {**plan().to_fields(), **change}
    fields = {k: v for k, v in fields.items() if v is not None}
    with pytest.raises(CorruptRecordError, match=message) as info:
        PlanEntry.from_fields("fdeplb:{c}:plan:p", fields)
    assert info.value.key == "fdeplb:{c}:plan:p"
