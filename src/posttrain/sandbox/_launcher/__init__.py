"""The launcher: a small single-threaded helper process per worker slot that runs bubblewrap jails.

It is started as a plain program (``python -S -E -s <this dir> CONFIG``), imports only the standard library,
and talks to the trainer over two pipes (`wire`). Being its own process is the point: the trainer is
multi-threaded, and forking, ``setuid`` and rlimits between fork and exec are only safe in a process with one
thread. It is also a child subreaper, so every orphan a jail leaves is reaped here and never counts against the
slot's process limit.
"""
