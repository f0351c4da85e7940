"""python runat.py ROOT args...: python -m mtpflow.bench from the checkout at ROOT (not the editable install)"""
import sys, runpy
root = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower() and "editable" not in type(f).__module__.lower()]
sys.path.insert(0, root)
sys.argv = ["mtpflow.bench"] + sys.argv[2:]
import mtpflow; assert mtpflow.__file__.startswith(root), mtpflow.__file__
runpy.run_module("mtpflow.bench", run_name="__main__", alter_sys=True)
