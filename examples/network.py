"""A sandbox whose traffic leaves only through fanfold's filtering proxy, and a port reached from the host."""

import http.server
import threading
import urllib.request

from fanfold import EngineConfig, Fleet

# A stand-in for the internet: a server on this host's loopback, which the proxy reaches only
# because this fleet's operator says so (loopback, private and metadata addresses are off limits).
class Site(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
threading.Thread(target=site.serve_forever, daemon=True).start()
docs = f"docs.example.test:{site.server_port}"
config = EngineConfig(net_reachable=("127.0.0.0/8",), net_hosts=(("docs.example.test", ("127.0.0.1",)),))

with Fleet(config=config) as fleet:
    box = fleet.create("host", network={"allow": [docs]})
    print(box.exec(f"curl -s -o /dev/null -w '%{{http_code}}' http://{docs}/").text)         # 200
    print(box.exec("curl -s -o /dev/null -w '%{http_code}' http://pypi.org/").text)          # 403: not allowed
    print(box.exec("curl -s --noproxy '*' http://1.1.1.1/ || echo no route").text.strip())   # raw IP: nowhere to go
    print(box.network_stats()["denied"])                                                     # 1
    box.set_network("none", cut=True)                                                        # locked from now on

    box.exec("mkdir -p /srv && echo hello from inside > /srv/index.html")
    box.exec("cd /srv && (setsid python3 -m http.server 8000 >/dev/null 2>&1 &)")
    box.exec("for i in $(seq 100); do curl -s localhost:8000 >/dev/null && break; sleep 0.05; done")
    print(urllib.request.urlopen(box.expose(8000)).read().decode().strip())                  # hello from inside
site.shutdown()
