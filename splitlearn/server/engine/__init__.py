"""What the segment server does, behind HTTP: the runtime, steps, sessions, memory."""
