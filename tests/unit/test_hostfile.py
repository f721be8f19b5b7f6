"""pytest tests/unit/test_hostfile.py — hostfile, --include/--exclude and Slurm parsing (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.errors import HostfileError
from zerorun.launch.hostfile import parse_filter, parse_hostfile, select_hosts, slurm_hosts
from zerorun.worker.slurm_env import expand_nodelist, expand_tasks_per_node

host_names = st.from_regex(r"[a-z][a-z0-9\-]{0,8}(\.[a-z0-9]{1,4})?", fullmatch=True)
hostfiles = st.dictionaries(host_names, st.integers(1, 16), min_size=1, max_size=6)


def render(hosts: dict[str, int], comments: bool = True) -> str:
    lines = ["# cluster", ""] if comments else []
    lines += [f"  {host}   slots={slots}  # node" for host, slots in hosts.items()]
    return "\n".join(lines) + "\n\n"


def test_parses_deepspeed_format_with_comments_and_blank_lines():
    text = "# two nodes\n\nworker-0 slots=4\n   \nworker-1 slots=2 # small one\n"
    assert parse_hostfile(text) == {"worker-0": 4, "worker-1": 2}
    assert list(parse_hostfile(text)) == ["worker-0", "worker-1"]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("worker-0 slots=4\nworker-1\n", "hostfile line 2: expected 'HOST slots=N'"),
        ("worker-0 slots=four\n", "line 1: slots must be a positive integer, got 'four'"),
        ("worker-0 slots=0\n", "line 1: slots must be a positive integer"),
        ("a slots=1\n# x\na slots=2\n", "line 3: host 'a' is listed twice"),
        ("worker-0 slots=1 extra\n", "line 1: expected"),
        ("w;rm slots=1\n", "line 1: 'w;rm' is not a valid host name"),
        ("# only comments\n\n", "names no hosts"),
    ],
)
def test_malformed_hostfile_names_the_line(text, fragment):
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failure
@given(hostfiles, st.booleans())
def test_rendered_hostfiles_parse_back(hosts, comments):
    assert parse_hostfile(render(hosts, comments)) == hosts


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_any_text_parses_or_gives_one_line_error(text):
    try:
        hosts = parse_hostfile(text)
    except HostfileError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert hosts and all(count >= 1 for count in hosts.values())


def test_include_picks_hosts_and_slots_in_hostfile_order():
    hosts = {"worker-0": 4, "worker-1": 4, "worker-2": 2}
    assert select_hosts(hosts, include="worker-1@worker-0:0,2") == {"worker-0": [0, 2], "worker-1": [0, 1, 2, 3]}


def test_exclude_removes_slots_and_empty_hosts():
    hosts = {"worker-0": 2, "worker-1": 2}
    assert select_hosts(hosts, exclude="worker-0:1@worker-1") == {"worker-0": [0]}
    assert select_hosts(hosts, exclude="worker-1:0,1") == {"worker-0": [0, 1]}


def test_num_nodes_takes_the_first_hosts():
    assert select_hosts({"a": 1, "b": 2, "c": 3}, num_nodes=2) == {"a": [0], "b": [0, 1]}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"include": "worker-9"}, "--include names host 'worker-9', which is not in the hostfile"),
        ({"include": "worker-0:7"}, "slot 7 of 'worker-0' does not exist"),
        ({"include": "worker-0:x"}, "slot 'x' is not a non-negative integer"),
        ({"include": "worker-0:"}, "slot '' is not"),
        ({"include": "worker-0@worker-0"}, "appears twice"),
        ({"include": "worker-0", "exclude": "worker-0"}, "cannot be used together"),
        ({"exclude": "worker-0@worker-1"}, "leave no slots"),
        ({"num_nodes": 3}, "--num-nodes 3 asks for more hosts"),
        ({"include": "@"}, "is not a valid host name"),
    ],
)
def test_bad_filters_name_the_token(kwargs, fragment):
    with pytest.raises(HostfileError) as info:
        select_hosts({"worker-0": 2, "worker-1": 2}, **kwargs)
    assert fragment in str(info.value)


filter_texts = st.text(alphabet="ab01:,@- 9x", max_size=20)


@settings(max_examples=300, deadline=None)
@given(hostfiles, filter_texts, st.sampled_from(["include", "exclude"]), st.none() | st.integers(-1, 8))
def test_filters_return_a_subset_or_one_line_error(hosts, spec, which, num_nodes):
    hosts = {"a": 2, "b": 3, **hosts}
    try:
        chosen = select_hosts(hosts, num_nodes=num_nodes, **{which: spec})
    except HostfileError as err:
        assert "\n" not in str(err)
        return
    assert chosen
    order = list(hosts)
    assert [order.index(h) for h in chosen] == sorted(order.index(h) for h in chosen)
    for host, slots in chosen.items():
        assert slots and set(slots) <= set(range(hosts[host]))
        assert len(set(slots)) == len(slots)


def test_slurm_nodelist_expansion_keeps_zero_padding():
    assert expand_nodelist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    assert expand_nodelist("n[8-10]-ib") == ["n8-ib", "n9-ib", "n10-ib"]
    assert expand_tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu]1[", "gpu[3-1]", "gpu[a-b]", "a,,b", ""])
def test_bad_slurm_nodelists_raise_hostfile_error(bad):
    with pytest.raises(HostfileError):
        expand_nodelist(bad)


def test_slurm_hosts_from_environment():
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "3(x2)"}
    assert slurm_hosts(env) == {"node1": 3, "node2": 3}
    assert slurm_hosts({**env, "SLURM_GPUS_ON_NODE": "8"}) == {"node1": 8, "node2": 8}
    assert slurm_hosts({}) is None


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab1-9[],x()", max_size=24), st.text(alphabet="0123(x),", max_size=10))
def test_slurm_fuzz_gives_hosts_or_one_line_error(nodelist, tasks):
    try:
        hosts = slurm_hosts({"SLURM_JOB_NODELIST": nodelist or "x", "SLURM_TASKS_PER_NODE": tasks})
    except HostfileError as err:
        assert "\n" not in str(err)
        return
    assert hosts and all(count >= 1 for count in hosts.values())


def test_parse_filter_none_means_all_slots():
    assert parse_filter("a@b:1,0") == {"a": None, "b": [1, 0]}
