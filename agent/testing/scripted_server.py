"""A scripted OpenAI-compatible chat server: real HTTP for the real `openai` client, playing the
replies a test (or a careless model's scenario) scripts.

It answers with scripted tool calls (one, or several in one reply), counts prompt tokens as ~3
characters each, reports the shared prefix with the previous request as cached tokens (like
vLLM's prefix cache), refuses prompts over its context length with vLLM's error text, and can be
told to fail with 503s.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedServer:
    def __init__(self, max_model_len: int = 8192):
        self.max_model_len = max_model_len
        # each reply: {"tool": name, "arguments": json}, {"calls": [{"tool", "arguments"}, ...]}
        # for several calls in one reply, or {"text": ...}; "reasoning" and "finish" optional
        self.script: list[dict[str, Any]] = []
        self.fail_next = 0  # how many requests answer 503 before succeeding
        self.requests: list[dict[str, Any]] = []
        self._previous = ""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.endswith("/models"):
                    self._send(
                        200,
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": "scripted",
                                    "object": "model",
                                    "owned_by": "test",
                                    "max_model_len": server.max_model_len,
                                }
                            ],
                        },
                    )
                else:
                    self._send(200, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, reply = server.answer(body)
                self._send(code, reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def tokens(text: str) -> int:
        return len(text) // 3 + 1

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.requests.append(body)
        if self.fail_next:
            self.fail_next -= 1
            return 503, {
                "error": {"message": "overloaded", "type": "ServiceUnavailable", "code": 503}
            }
        text = json.dumps(body.get("tools", [])) + "".join(
            json.dumps(m, sort_keys=True) for m in body["messages"]
        )
        prompt = self.tokens(text) + 7 * len(body["messages"])
        if prompt + body.get("max_tokens", 0) > self.max_model_len:
            return 400, {
                "object": "error",
                "type": "BadRequestError",
                "code": 400,
                "message": (
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {prompt + body.get('max_tokens', 0)} tokens ({prompt} in the messages, "
                    f"{body.get('max_tokens', 0)} in the completion). Please reduce the length."
                ),
            }
        shared = 0
        for a, b in zip(self._previous, text, strict=False):
            if a != b:
                break
            shared += 1
        self._previous = text
        step = self.script.pop(0) if self.script else {"text": "nothing scripted"}
        message: dict[str, Any] = {"role": "assistant", "content": step.get("text")}
        if "reasoning" in step:  # as vLLM's reasoning parser answers
            message["reasoning"] = step["reasoning"]
        calls = step.get("calls") or ([step] if "tool" in step else [])
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call{len(self.requests)}-{i}",
                    "type": "function",
                    "function": {"name": c["tool"], "arguments": c["arguments"]},
                }
                for i, c in enumerate(calls)
            ]
        return 200, {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": step.get("finish", "tool_calls" if calls else "stop"),
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 12,
                "total_tokens": prompt + 12,
                "prompt_tokens_details": {"cached_tokens": self.tokens(text[:shared]) // 16 * 16},
            },
        }

    def close(self) -> None:
        self.httpd.shutdown()
