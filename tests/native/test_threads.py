"""The thread governor (mtpflow.backends.native.threads): all threads on a quiet machine, one while the forwards run
far slower than their fastest (a core taken), all again after the back-off."""
import pytest
import torch

from mtpflow.backends.native import threads as T


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Model:  # a stand-in for the weights a forward runs (weakly referenced)
    pass


MODEL = Model()


def run(governor, seconds, rows=1, model=MODEL):
    """One forward of ``rows`` rows of ``model`` that takes ``seconds`` on the governor's count; returns that
    count."""
    n = governor.threads()
    governor.observe(model, rows, seconds, n)
    return n


def machine(governor, two, one, rows=1, model=MODEL):
    """One forward on a machine where it takes ``two`` seconds on two threads and ``one`` on one; returns the count
    it ran on."""
    n = governor.threads()
    governor.observe(model, rows, two if n == 2 else one, n)
    return n


QUIET = (0.005, 0.0085)  # seconds on two threads, on one: a quiet machine's two cores
TAKEN = (0.015, 0.009)  # another process on one core: the two-thread forwards wait on the thread that lost its core


def test_a_quiet_machine_keeps_every_thread(two_threads):
    """On a quiet machine the odd slow forward decides nothing, and each trial of one thread (PROBE forwards, the
    first after WINDOW, then one every EXPLORE) goes back to all threads."""
    g = T.ThreadGovernor(enabled=True)
    noise = [1.0, 1.3, 1.1, 1.9, 1.0, 1.2, 5.0, 1.1]
    forwards = T.WINDOW + 2 * T.EXPLORE + 3 * T.PROBE
    counts = [machine(g, QUIET[0] * noise[i % 8], QUIET[1] * noise[i % 8]) for i in range(forwards)]
    assert g.trials == 3 and counts.count(1) == 3 * T.PROBE
    assert g.switches == 0 and not g.one and torch.get_num_threads() == 2


def test_a_taken_core_sends_the_forwards_to_one_thread_then_all_are_tried_again(two_threads):
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        machine(g, *QUIET)
    assert g.trials == 1 and all(machine(g, *QUIET) == 1 for _ in range(T.PROBE)) and not g.one
    # a core taken: every forward three times its fastest; the decision waits until they are half a window or more
    slow = 0
    while g.switches == 0 and slow < 2 * T.WINDOW:
        assert machine(g, *TAKEN) == 2
        slow += 1
    assert T.WINDOW // 2 <= slow <= T.WINDOW and torch.get_num_threads() == 1
    assert [machine(g, *TAKEN) for _ in range(T.BACKOFF)] == [1] * T.BACKOFF
    # still taken: a trial of PROBE forwards on all threads, slower, and back to one
    assert [machine(g, *TAKEN) for _ in range(T.PROBE)] == [2] * T.PROBE
    assert g.switches == 1 and g.one and g.threads() == 1
    assert [machine(g, *QUIET) for _ in range(T.BACKOFF)] == [1] * T.BACKOFF
    # the core is back: the next trial finds all threads faster, and they stay
    assert [machine(g, *QUIET) for _ in range(T.PROBE)] == [2] * T.PROBE
    assert not g.one and torch.get_num_threads() == 2
    assert {machine(g, *QUIET) for _ in range(3 * T.WINDOW)} == {2} and g.switches == 1


def test_a_process_that_starts_on_a_taken_core_finds_one_thread_faster(two_threads):
    """Its fastest forward on all threads is a slow one, so the quick switch never fires; the first trial (after
    WINDOW forwards) finds one thread faster and keeps it."""
    g = T.ThreadGovernor(enabled=True)
    assert [machine(g, *TAKEN) for _ in range(T.WINDOW)] == [2] * T.WINDOW
    assert [machine(g, *TAKEN) for _ in range(T.PROBE)] == [1] * T.PROBE
    assert g.one and g.switches == 1 and torch.get_num_threads() == 1
    assert {machine(g, *TAKEN) for _ in range(T.BACKOFF)} == {1}


def test_a_trial_compares_forwards_of_the_same_rows(two_threads):
    """Trial forwards of a row count the count in use has not run yet are not compared: a verify of 9 rows on one
    thread is not judged against one-row steps on two."""
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        machine(g, *QUIET)
    for _ in range(T.PROBE):
        machine(g, 0.001, 0.002, rows=9)  # would look faster than the one-row steps
    assert not g.one and g.switches == 0


def test_prefills_and_single_thread_processes_are_left_alone(two_threads):
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        run(g, 0.005, rows=T.MAX_ROWS + 1)
    for _ in range(T.WINDOW):
        run(g, 0.5, rows=T.MAX_ROWS + 1)  # a prefill chunk's time is not a decode forward's
    assert g.switches == 0
    torch.set_num_threads(1)
    one = T.ThreadGovernor(enabled=True)
    for seconds in [0.005] * T.WINDOW + [0.5] * T.WINDOW:
        assert run(one, seconds) == 1
    assert one.switches == 0


def test_off_means_torchs_count(two_threads, monkeypatch):
    monkeypatch.setenv("MTPFLOW_ADAPT_THREADS", "0")
    g = T.ThreadGovernor()
    for seconds in [0.005] * T.WINDOW + [0.5] * T.WINDOW:
        assert run(g, seconds) == 2
    assert g.switches == 0


def test_each_model_is_compared_with_its_own_forwards(two_threads):
    """A float32 model's forwards, three times an int8 model's in the same process, are not a taken core."""
    g = T.ThreadGovernor(enabled=True)
    int8, float32 = Model(), Model()
    for _ in range(T.WINDOW):
        machine(g, 0.005, 0.0085, model=int8)
    for _ in range(3 * T.WINDOW):
        machine(g, 0.015, 0.025, model=float32)
    assert g.switches == 0 and not g.one


def test_a_cheaper_kind_of_forward_is_not_the_measure_of_the_models_own(two_threads):
    """A draft through the int8 copy (or the first layers only) of the same model, a third of a full forward's time,
    does not make the full forwards look slow."""
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        n = g.threads()
        g.observe(MODEL, 1, 0.005 if n == 2 else 0.0085, n, kind=True)  # the draft forwards
    for _ in range(3 * T.WINDOW):
        n = g.threads()
        g.observe(MODEL, 1, 0.015 if n == 2 else 0.025, n, kind=False)  # the target's own
    assert g.switches == 0 and not g.one


def test_a_trial_sets_torchs_count_only_for_its_forwards(two_threads):
    """A trial's forward runs its torch parts on the trial's count too (it measures what that count would give);
    between forwards torch has the count the process decided on, so a request that ends inside a trial leaves the
    rest of the process (an HF forward, the bench's HF generate) as it was."""
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        machine(g, *QUIET)
    assert g.trial == T.PROBE and torch.get_num_threads() == 2
    assert g.threads(forward=False) == 1 and torch.get_num_threads() == 2
    n = g.threads()
    assert n == 1 and torch.get_num_threads() == 1
    g.observe(MODEL, 1, QUIET[1], n)
    assert torch.get_num_threads() == 2
    for _ in range(T.PROBE - 1):
        machine(g, *QUIET)
    assert g.threads() == 2 and torch.get_num_threads() == 2 and not g.one
    # a prefill chunk (more rows than a decode forward) inside a trial is not compared and leaves torch's count alone
    for _ in range(T.EXPLORE):
        machine(g, *QUIET)
    assert g.trial == T.PROBE
    n = g.threads()
    g.observe(MODEL, T.MAX_ROWS + 1, 0.5, n)
    assert torch.get_num_threads() == 2 and g.trial == T.PROBE
