"""Drives `toolctl mcp` with the `mcp` package's client and prints what it saw as JSON.

Usage: mcp_client.py SCENARIO CONFIG_JSON

CONFIG_JSON: {"command": ..., "args": [...], "env": {...}} to start the server on stdio, or
{"url": "http://127.0.0.1:PORT/mcp", "token": "..."} (the bearer token); "mode": "legacy" (2025-11-25, initialize handshake) or
"auto" (2026-07-28); plus what the scenario needs. Every wait is bounded.
"""

import json
import os
import sys

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

WAIT = 20.0


def dump(value):
    return value.model_dump(by_alias=True, exclude_none=True, mode="json")


def server(cfg):
    if "url" in cfg and "token" in cfg:
        headers = {"Authorization": f"Bearer {cfg['token']}"}
        http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300))
        return streamable_http_client(cfg["url"], http_client=http)
    if "url" in cfg:
        return cfg["url"]
    return StdioServerParameters(command=cfg["command"], args=cfg["args"], env=cfg["env"])


class Changes:
    """`notifications/tools/list_changed`: unprompted on 2025-11-25, through
    `subscriptions/listen` on 2026-07-28."""

    def __init__(self):
        self.count = 0
        self.event = anyio.Event()

    async def handler(self, message):
        if isinstance(message, types.ToolListChangedNotification):
            self.seen()

    def seen(self):
        self.count += 1
        self.event.set()

    async def listen(self, client, task_status=anyio.TASK_STATUS_IGNORED):
        async with client.listen(tools_list_changed=True) as sub:
            task_status.started()
            async for _event in sub:
                self.seen()

    def clear(self):
        self.event = anyio.Event()

    async def wait(self):
        with anyio.move_on_after(WAIT):
            await self.event.wait()
            return True
        return False


async def connect(cfg, changes=None, **kwargs):
    return Client(
        server(cfg),
        mode=cfg.get("mode", "auto"),
        message_handler=changes.handler if changes else None,
        read_timeout_seconds=60,
        **kwargs,
    )


async def tool_names(client):
    return [t.name for t in (await client.list_tools()).tools]


async def basics(cfg):
    out = {}
    changes = Changes()
    async with await connect(cfg, changes) as client, anyio.create_task_group() as tg:
        out["protocol"] = client.protocol_version
        if cfg.get("mode") != "legacy":
            await tg.start(changes.listen, client)
        out["tools"] = [dump(t) for t in (await client.list_tools()).tools]
        out["greet"] = dump(await client.call_tool("greet", {"name": "world"}))
        out["jsonout"] = dump(await client.call_tool("jsonout", {}))
        out["fail"] = dump(await client.call_tool("fail", {}))

        messages = []

        async def on_progress(progress, total, message):
            messages.append({"progress": progress, "message": message})

        out["slow"] = dump(await client.call_tool("slow", {}, progress_callback=on_progress))
        out["progress"] = messages

        changes.clear()
        out["load"] = dump(await client.call_tool("tool_load", {"name": "extra"}))
        out["load_changed"] = await changes.wait()
        out["after_load"] = await tool_names(client)
        out["load_unknown"] = dump(await client.call_tool("tool_load", {"name": "no_such_tool"}))

        changes.clear()
        with open(cfg["edit_path"], "w") as f:
            f.write(cfg["edit_content"])
        out["edit_changed"] = await changes.wait()
        tools = (await client.list_tools()).tools
        out["edited"] = [dump(t) for t in tools if t.name == "greet"]
        tg.cancel_scope.cancel()
    return out


async def cancel(cfg):
    """Calls `sleeper`, which writes its pid and sleeps, and cancels the call once the pid is
    there; prints the pid for the test to watch."""
    out = {}
    pid_file = cfg["pid_file"]
    async with await connect(cfg) as client:
        with anyio.move_on_after(WAIT) as scope:
            async with anyio.create_task_group() as tg:
                async def call():
                    out["result"] = dump(await client.call_tool("sleeper", {}))

                tg.start_soon(call)
                while not (os.path.exists(pid_file) and open(pid_file).read().strip()):
                    await anyio.sleep(0.05)
                out["pid"] = int(open(pid_file).read().strip())
                tg.cancel_scope.cancel()
        out["timed_out"] = scope.cancelled_caught and "pid" not in out
        # The server still answers after a cancelled call.
        out["after"] = "greet" in await tool_names(client)
    return out


async def search(cfg):
    async with await connect(cfg) as client:
        return {"search": dump(await client.call_tool("tool_search", {"query": cfg["query"], "limit": 3}))}


async def multihost(cfg):
    out = {}
    async with await connect(cfg) as client:
        out["tools"] = [dump(t) for t in (await client.list_tools()).tools]
        for name, args in cfg["calls"].items():
            out[name] = dump(await client.call_tool("where", args))
    return out


async def approve(cfg):
    """Lists the tools, searches for `tool`, loads it (again) and calls it, with an elicitation
    callback that answers `answer` (or none at all)."""
    out = {"elicitations": [], "progress": []}

    async def elicit(context, params):
        out["elicitations"].append(dump(params))
        return types.ElicitResult(action="accept", content={"approve": cfg["answer"]})

    async def on_progress(progress, total, message):
        out["progress"].append(message)

    kwargs = {"elicitation_callback": elicit} if "answer" in cfg else {}
    async with await connect(cfg, **kwargs) as client:
        out["tools"] = [dump(t) for t in (await client.list_tools()).tools]
        out["search"] = dump(await client.call_tool("tool_search", {"query": cfg["tool"]}))
        out["load"] = dump(await client.call_tool("tool_load", {"name": cfg["tool"]}))
        result = await client.call_tool(cfg["tool"], {}, progress_callback=on_progress)
        out["result"] = dump(result)
    return out


async def hostile(cfg):
    """Sends what a careless or hostile model might: each request gets an answer of its own
    (an error result, or a protocol error for a tool that does not exist), and the server
    goes on serving. Records the result or the protocol error of each, then a plain call."""
    out = {}
    requests = {
        "long_query": ("tool_search", {"query": "disk " * 1000}),
        "bad_limit": ("tool_search", {"query": "greet", "limit": "many"}),
        "negative_limit": ("tool_search", {"query": "greet", "limit": -1}),
        "fractional_limit": ("tool_search", {"query": "greet", "limit": 2.5}),
        "float_limit": ("tool_search", {"query": "greet", "limit": 2.0}),
        "no_query": ("tool_search", {}),
        "odd_load": ("tool_load", {"name": "../etc/\u0000passwd\u202e"}),
        "huge_load": ("tool_load", {"name": "x" * 200_000}),
        "number_load": ("tool_load", {"name": 7}),
        "wrong_type": ("greet", {"name": 123}),
        "missing_arg": ("greet", {}),
        "huge_arg": ("greet", {"name": "y" * (2 << 20)}),
        "odd_arg": ("greet", {"name": "\u0000\u202e\ufffd"}),
        "unknown": ("no_such_tool", {}),
    }
    async with await connect(cfg) as client:
        for key, (tool, args) in requests.items():
            try:
                out[key] = dump(await client.call_tool(tool, args))
            except Exception as e:  # a protocol error: recorded, and the next request goes on
                out[key] = {"protocolError": f"{type(e).__name__}: {e}"}
        out["after"] = dump(await client.call_tool("greet", {"name": "still here"}))
    return out


async def http(cfg):
    async with await connect(cfg) as client:
        return {
            "protocol": client.protocol_version,
            "tools": await tool_names(client),
            "greet": dump(await client.call_tool("greet", {"name": "http"})),
        }


async def host_only(cfg):
    """Lists the session's tools, searches for `query` and loads `load`."""
    async with await connect(cfg) as client:
        return {
            "tools": [dump(t) for t in (await client.list_tools()).tools],
            "search": dump(await client.call_tool("tool_search", {"query": cfg["query"]})),
            "load": dump(await client.call_tool("tool_load", {"name": cfg["load"]})),
        }


SCENARIOS = {
    f.__name__: f
    for f in (basics, cancel, search, multihost, approve, hostile, http, host_only)
}


def main():
    scenario, cfg = sys.argv[1], json.loads(sys.argv[2])
    out = anyio.run(SCENARIOS[scenario], cfg)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
