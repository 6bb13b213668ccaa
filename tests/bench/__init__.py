"""Tests of the trace benchmark's pieces (bench/trace.py runs them; tests never import bench)."""
