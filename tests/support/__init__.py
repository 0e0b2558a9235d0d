"""What the test files share, and nothing else: no test lives here (docs/contributing.md,
"Where tests go"). Each module's docstring names the files it serves.

Imported by the tests (``from tests.support import servers``):
  servers, tcp_proxy        real redis-servers and clusters, faults on the wire
  contract, rules           the contract and rules tests' sessions, numbers, invariants
  bad_input, turn_state     a session's stored state, compared before and after a call
  concurrency, jobs, worker_scenarios
                            processes started with spawn; the worker tests' jobs,
                            compactors and in-process workers
  stateful, rules_model, rules_machine
                            the property tests' models and state machines
  older, tools              a protocol 1 client; the repository's generators as modules
  spec_calls                a mutating script's valid call, derived from its spec (fuzz)
  agent_process             an agent OS process driven over its stdin and stdout
  redis_clock               Redis's clock (TIME), and a wait until it passes a deadline

Run as scripts by path or module (a fleet test's agent and worker processes, or by hand):
  reset_agent.py, two_call_agent.py, upgrade_agent.py, fleet_ceilings.py,
  fleet_counting.py, nopause_fleet.py, nopause_reset.py; fleet_compactor (a worker's
  ``--compactor tests.support.fleet_compactor:SUMMARIZER``); history/
  (``python -m tests.support.history``, docs/reliability.md).

Data: protocol_vectors.json, the wire protocol's test vectors (docs/protocol.md).
"""
