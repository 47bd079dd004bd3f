"""Data-parallel routing (server/router.py): a prompt goes where its longest remembered prefix went, unless that
replica is busier than the least loaded one by more than the allowed imbalance; otherwise to the least loaded."""
from specserve.server.router import PrefixRouter

PAGE = 4
SYSTEM = list(range(100, 120))           # a shared 20-token prefix: 5 whole pages


def test_a_shared_prefix_follows_its_replica_while_the_load_allows():
    router = PrefixRouter(2, PAGE, max_imbalance=2)
    assert router.route(SYSTEM + [1, 2], load=[0, 0]) == 0
    # replica 0 is busier, but within the imbalance: the prefix stays where it is cached
    assert router.route(SYSTEM + [3], load=[2, 0]) == 0
    # an unrelated prompt goes to the least loaded replica
    assert router.route([7, 8, 9, 10, 11], load=[2, 0]) == 1
    # beyond the imbalance the load wins, and the prefix moves with it
    assert router.route(SYSTEM + [4], load=[3, 0]) == 1
    assert router.route(SYSTEM + [5], load=[1, 1]) == 1


def test_the_longest_remembered_prefix_decides():
    router = PrefixRouter(3, PAGE)
    assert router.route(SYSTEM[:8], load=[0, 0, 0]) == 0          # pages 1-2 → replica 0
    assert router.route([0] * 8, load=[1, 0, 0]) == 1
    assert router.route(SYSTEM, load=[1, 1, 0]) == 0              # pages 1-2 remembered for 0; all 5 recorded
    assert router.route(SYSTEM + [1] * 4, load=[2, 1, 0]) == 0
    # less than a page in common remembers nothing: the least loaded one
    assert router.route(SYSTEM[:3], load=[3, 1, 0]) == 2


def test_memory_is_bounded_to_the_most_recent_pages():
    router = PrefixRouter(2, PAGE, capacity=3)
    router.route(SYSTEM, load=[0, 0])                              # 5 pages, the first 2 forgotten
    assert len(router._owner) == 3
    assert router.route(SYSTEM[:8], load=[0, 0]) == 0              # forgotten: least loaded (the tie) again
    assert router.route(SYSTEM[:8], load=[1, 0]) == 0              # remembered again, within the imbalance


def test_one_replica_takes_everything_and_remembers_nothing():
    router = PrefixRouter(1, PAGE)
    assert router.route(SYSTEM, load=[5]) == 0 and not router._owner
