"""What a GPU node's commands (`coral serve …`) take from the planner's side: layer splits and vLLM's KV-transfer
configuration; both light, so a node without the planner's stack imports them."""

from coral_dagster.layer_split import parse_split as parse_split
from coral_dagster.templates.engines import KV_ROLES as KV_ROLES, vllm_kv_transfer_config as vllm_kv_transfer_config
