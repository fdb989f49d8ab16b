"""The fdeplb test suite: one folder per package, faults/ for the process-killing suites, repo/ for checks of the
repository as a whole; helpers.py, api_helpers.py and servers.py are shared (import them as ``tests.helpers``)."""
