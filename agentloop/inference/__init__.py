"""The server side: SGLang servers that agentloop launches itself, and how a run gets its ServerManager.

    launcher.py   LocalServer: start, health-wait and stop one SGLang server (CPU or GPU), logs kept
    serving.py    server pools (by URL, local; the protocol a Ray pool implements) and `serving(cfg, model, run_dir)`,
                  a started ServerManager over a pool's servers
    sglang_cpu/   pure-torch stand-ins for the sgl_kernel CPU ops PyPI's wheels lack

May import: the vocabulary, util and the client (server_manager).
"""
