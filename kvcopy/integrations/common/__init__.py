"""What every engine adapter shares: the offload session (host pools, decisions, deferred frees), its
counters, the Planner that learns while the engine serves, and the clock that times forwards and resumed
requests. Engine-independent: nothing here imports an engine."""
