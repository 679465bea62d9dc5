"""fanfold on a Ray cluster: a ``fanfold serve`` per node, started and found through Ray, and a
fleet transport that routes each call straight to the node holding the sandbox.

``fanfold ray start`` (or ``start_cluster``) puts a controller on the cluster that keeps one
``FanfoldNode`` on every node; ``AsyncFleet("ray://auto")`` finds them; ``trajectories.ClusterTrajectoryStore`` is one trajectory
store that rollout workers on every node write to. Only this package imports ``ray`` (the ``ray`` extra).
"""
