"""Runs the pristine tests against the project in the working directory; prints JSON counts."""
import importlib.util
import json
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, ".")
# Loaded under a name of its own, so a test_stats.py the agent edited is never the one run.
spec = importlib.util.spec_from_file_location("pristine_test_stats", "/opt/grader/test_stats.py")
module = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(module)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    result = unittest.TextTestRunner(stream=open("/dev/null", "w"), verbosity=0).run(suite)
    passed, total = result.testsRun - len(result.failures) - len(result.errors), result.testsRun
except Exception:  # the project does not import: nothing passes
    passed, total = 0, open("/opt/grader/test_stats.py").read().count("def test_")
print(json.dumps({"passed": passed, "total": total}))
