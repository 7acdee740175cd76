"""Pieces every layer uses: bounded Ray calls and their errors (``calls``), who an actor is (``actor_identity``), timelines (``timeline``) and timed phases (``stopwatch``)."""
