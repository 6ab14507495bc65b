"""The launcher: a small single-threaded helper process per worker slot that runs bubblewrap jails.

It is started as a plain program (``python -S -E -s <this dir> CONFIG``), imports only the standard library,
and talks to the trainer over two pipes (`wire`). Being its own process is the point: the trainer is
multi-threaded, and the launcher runs as root and changes its own real ids around every spawn of bubblewrap
(`spawn`), which must never happen under another thread's feet. It is also a child subreaper, so every orphan
a jail leaves is reaped here and never counts against the slot's process limit.
"""
