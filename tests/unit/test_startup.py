"""Start-up watch: an app that cannot come up fails with Serve's reason instead of hanging."""

from __future__ import annotations

import pytest

from kvtide.cluster.startup import StartupFailed, StartupWatch

OOM = ("A replica failed to start with exception. Retrying. Error:\nValueError: Free memory on device cuda:0 "
       "(119.03/139.8 GiB) on startup is less than desired GPU memory utilization")


def test_running_app_is_serving():
    """RUNNING ends the wait at once."""
    assert StartupWatch(grace_s=10).serving("RUNNING", "", {"Engine": ""}, now_s=0.0)


def test_deploying_without_failures_keeps_waiting_forever():
    """A slow but healthy start (no failure message) is never cut off: engines may take minutes."""
    watch = StartupWatch(grace_s=10)
    assert not any(watch.serving("DEPLOYING", "", {"Engine": "Deploying."}, now_s=t) for t in (0.0, 100.0, 1e4))


def test_deploy_failed_raises_with_the_replica_error():
    """Serve giving up raises at once, quoting the deployment's message."""
    with pytest.raises(StartupFailed, match="Free memory on device"):
        StartupWatch(grace_s=10).serving("DEPLOY_FAILED", "", {"Engine": OOM.replace("A replica", "The deployment")},
                                         now_s=0.0)


def test_failures_persisting_past_the_grace_period_raise():
    """Retries that keep failing (Serve retries forever once a replica runs) raise after grace_s, not before."""
    watch = StartupWatch(grace_s=180)
    assert not watch.serving("DEPLOYING", "", {"Engine": OOM}, now_s=1000.0)
    assert not watch.serving("DEPLOYING", "", {"Engine": OOM}, now_s=1179.0)
    with pytest.raises(StartupFailed, match="Engine: A replica failed to start"):
        watch.serving("DEPLOYING", "", {"Engine": OOM}, now_s=1180.0)


def test_a_retry_that_clears_the_failure_restarts_the_clock():
    """A transient failure followed by a clean message does not count toward the next failure's grace."""
    watch = StartupWatch(grace_s=180)
    watch.serving("DEPLOYING", "", {"Engine": OOM}, now_s=0.0)
    watch.serving("DEPLOYING", "", {"Engine": "Deploying."}, now_s=100.0)
    assert not watch.serving("DEPLOYING", "", {"Engine": OOM}, now_s=200.0)
    assert not watch.serving("DEPLOYING", "", {"Engine": OOM}, now_s=379.0)
