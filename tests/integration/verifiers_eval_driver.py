"""verifiers' own evaluation of scripted completions (run by the verifiers virtualenv's Python, no agentloop import):
the library's code path of the parity test in test_envs_verifiers.py.

    python verifiers_eval_driver.py ENV_SPEC ENV_ARGS_JSON COMPLETIONS_JSON OUT_JSON

A fake OpenAI Chat Completions server answers each request with the completion scripted for its last user message
(COMPLETIONS_JSON: {question: completion}); `env.evaluate(client, model, num_examples=-1)` runs the environment's
eval dataset through it, as its users evaluate a model; OUT_JSON gets {example_id: reward}.
"""

import asyncio
import importlib.util
import json
import os
import sys

from aiohttp import web


async def main(spec, args, completions, out):
    import verifiers as vf

    async def chat(request):
        body = await request.json()
        question = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        text = completions[question]
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        mod_spec = importlib.util.spec_from_file_location("env_under_test", spec)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        env = module.load_environment(**args)
        os.environ["FAKE_KEY"] = "k"
        client = vf.ClientConfig(api_base_url=f"http://127.0.0.1:{port}/v1", api_key_var="FAKE_KEY", max_retries=0)
        results = await env.evaluate(client=client, model="m", num_examples=-1, rollouts_per_example=1,
                                     max_concurrent=64, on_progress=lambda *a, **k: None)
        rewards = {str(o["example_id"]): o["reward"] for o in results["outputs"]}
    finally:
        await runner.cleanup()
    with open(out, "w") as f:
        json.dump(rewards, f)


if __name__ == "__main__":
    spec, args, completions, out = sys.argv[1:5]
    with open(completions) as f:
        table = json.load(f)
    asyncio.run(main(spec, json.loads(args), table, out))
