"""Deterministic SkyPilot cluster names for the coordinator and the engine nodes."""

from __future__ import annotations

import hashlib
import re

from coral_dagster.errors import CoralError

# GCP caps a cluster's name on the cloud at 35 characters and SkyPilot appends "-" plus an 8-character user
# hash; at 26 characters or fewer our name reaches every cloud we use untruncated and unhashed.
MAX_CLUSTER_NAME_LEN = 26
# Lowercase letters, digits and single dashes: SkyPilot lowercases names and turns "." and "_" into "-" on
# the cloud, so anything else could make two of our names collide there.
CLUSTER_NAME_RE = re.compile(r"^[a-z](?:[a-z0-9]|-(?=[a-z0-9]))*$")
PLAN_TAG_LEN = 6
PHASE_LETTER = {"prefill": "p", "decode": "d", "aggregated": "a"}


def plan_tag(plan_id: str) -> str:
    """A short, stable tag of a plan id (hex of its SHA-1), so names stay short whatever the id looks like."""
    return hashlib.sha1(plan_id.encode()).hexdigest()[:PLAN_TAG_LEN]


def slug(text: str) -> str:
    """Lowercase, every run of other characters turned into one dash, no dash at either end."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _fit(head: str, tail: str) -> str:
    """`head-tail`, cutting `head` (never `tail`) to keep within the length limit."""
    room = MAX_CLUSTER_NAME_LEN - len(tail) - 1
    head = slug(head)[:max(room, 0)].rstrip("-")
    if not head or not head[0].isalpha():
        head = ("m" + head)[:max(room, 1)].rstrip("-")
    name = f"{head}-{tail}"
    if len(name) > MAX_CLUSTER_NAME_LEN or not CLUSTER_NAME_RE.match(name):
        raise CoralError(f"cannot make a cluster name of at most {MAX_CLUSTER_NAME_LEN} characters from "
                         f"{head!r} and {tail!r}.", "plans with fewer than 10,000 instances and 100 stages fit.")
    return name


def coordinator_name(plan_id: str) -> str:
    """The coordinator's cluster, named after the plan that first launched it."""
    return f"coral-{plan_tag(plan_id)}-coord"


def endpoint_name(plan_id: str) -> str:
    """The endpoint's cluster (HAProxy in front of the coordinator pair), named as the coordinator is."""
    return f"coral-{plan_tag(plan_id)}-endpoint"


def engine_name(plan_id: str, model: str, phase: str, instance: int, stage: int, node: int) -> str:
    """Engine node `node` of stage `stage` of instance number `instance` of a plan."""
    return _fit(model, f"{plan_tag(plan_id)}-i{instance}{PHASE_LETTER[phase]}-s{stage}n{node}")
