"""When a run misbehaves: a hung rank (watchdog: stacks, the node it waits for, exit HUNG), a straggler
(stragglers: named per log window, its node left out after a streak) and non-finite steps (non_finite: the
run stops, naming the last good checkpoint). It imports common/, run/checkpoint/ and the heartbeats the
watchdog writes for the job; a stop it asks for goes through the StopRequests (run/stops.py) it is handed."""
