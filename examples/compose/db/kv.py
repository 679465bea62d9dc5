"""A tiny key-value database over TCP, one command a line: `SET key value`, `GET key`, `INCR key`."""

import os
import socket
import socketserver
import sys

PORT = int(os.environ.get("KV_PORT", "7000"))


class Handler(socketserver.StreamRequestHandler):
    data: dict[str, str] = {}

    def handle(self) -> None:
        for line in self.rfile:
            verb, _, rest = line.decode().strip().partition(" ")
            key, _, value = rest.partition(" ")
            if verb == "SET":
                self.data[key] = value
                answer = "OK"
            elif verb == "INCR":
                self.data[key] = str(int(self.data.get(key, "0")) + 1)
                answer = self.data[key]
            elif verb == "GET":
                answer = self.data.get(key, "")
            else:
                answer = f"ERR unknown command {verb!r}"
            self.wfile.write(answer.encode() + b"\n")


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


if __name__ == "__main__":
    if sys.argv[1:] == ["--ping"]:  # the health check: the server answers
        with socket.create_connection(("127.0.0.1", PORT), timeout=2) as conn:
            conn.sendall(b"GET ping\n")
            conn.recv(64)
        sys.exit(0)
    with Server(("0.0.0.0", PORT), Handler) as server:
        server.serve_forever()
