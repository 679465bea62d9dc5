"""A web app that counts its visits in the database service (reached by name: DB_ADDRESS=db:7000)."""

import argparse
import http.server
import os
import socket


def db(command: str) -> str:
    host, _, port = os.environ["DB_ADDRESS"].partition(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(command.encode() + b"\n")
        return conn.makefile().readline().strip()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok\n" if self.path == "/health" else f"visit {db('INCR visits')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8080)
    http.server.ThreadingHTTPServer(("0.0.0.0", parser.parse_args().port), Handler).serve_forever()
