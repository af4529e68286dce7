"""Small helpers with no knowledge of RL: the build-once cache, run directories and record writers,
atomic file writes, the class-registry admission rule, and the command's one event loop.

    cache.py       build_once (file lock + temp dir + rename), import_python_file
    rundir.py      make_run_dir, RecordWriter, write_json, package versions
    fsio.py        atomic_write_text / atomic_write_bytes / atomic_write_json
    registries.py  admit_class: the rule every class registry applies
    runtime.py     run_async: uvloop when installed
    zygote.py      a fork server: imports a program once, forks one process per request (CPU SGLang servers and
                   one-rank learners are its programs)
    forked.py      its client: ask the zygote an environment variable names for a process, watch it (poll, wait)

May import: the vocabulary only.
"""
