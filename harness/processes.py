"""Stopping a server a test started as a plain subprocess (not through harness.stack): SIGTERM,
then SIGKILL if it has not gone within the grace period, so no test leaves a server behind."""
import subprocess


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """``proc`` ended and reaped: asked to stop, then killed after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
