"""Recovery: what lets a run go on without a person: the record of its attempts and the guard against a restart
loop, the hang watchdog, and the room that wires them (and goodput's phases) to the trainer."""
