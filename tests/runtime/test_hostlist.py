import pytest

from megatron_ds.runtime.hostlist import HostlistError, expand_hostlist, parse_tasks_per_node


@pytest.mark.parametrize("text, hosts", [
    ("nid001", ["nid001"]),
    ("nid[001-004,007]", ["nid001", "nid002", "nid003", "nid004", "nid007"]),
    ("nid[001-004,007],gpu-a[01-02],gpu-b7",
     ["nid001", "nid002", "nid003", "nid004", "nid007", "gpu-a01", "gpu-a02", "gpu-b7"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b,c", ["a", "b", "c"]),
    ("x3005c0s13b0n0,x3005c0s19b1n0", ["x3005c0s13b0n0", "x3005c0s19b1n0"]),
    ("gpu[7]", ["gpu7"]),
    ("host.example.org", ["host.example.org"]),
    ("", []),
])
def test_expand(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["nid[001-004", "nid001]", "nid[a-b]", "nid[4-1]", "nid[[1]]"])
def test_bad_hostlist_is_an_error(text):
    with pytest.raises(HostlistError, match="hostlist"):
        expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("8(x2)", [8, 8]), ("1,4", [1, 4])])
def test_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts
