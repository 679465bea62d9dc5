# OpenEnv's own client on a fanfold env: the token is the URL's password.
#   python examples/openenv_client.py http://HOST:8700 <fanfold token>
import sys
from urllib.parse import urlsplit

from openenv.core.generic_client import GenericEnvClient

url, token = urlsplit(sys.argv[1]), sys.argv[2]
with GenericEnvClient(base_url=f"http://fanfold:{token}@{url.netloc}/openenv/codefix").sync() as env:
    first = env.reset(seed=3)
    print(sorted(tool["function"]["name"] for tool in first.observation["tools"]))
    tested = env.step({"name": "run_tests", "arguments": {}})
    print(tested.done, tested.observation["text"].splitlines()[-1])
