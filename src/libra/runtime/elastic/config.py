"""The live elastic layer's timeouts and pacing: how long a partner gives a joiner at each stage.

They are generous by default: a stage that runs out rolls the join back, which costs a rollout
slot a few seconds; a timeout that fires on a loaded machine would roll back joins that were only
slow. None of them ever makes a core replica wait, except `grad_timeout_s` for a replica that is
already ACTIVE (a member of data parallelism like any core replica, see `reducer.py`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ElasticRuntimeConfig(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address the partners' side channels listen on")
    connect_timeout_s: float = Field(60.0, gt=0, description="A joiner's connection to its partner")
    fetch_timeout_s: float = Field(120.0, gt=0, description="Snapshot sent -> joiner restored, else rollback")
    sync_steps: int = Field(2, ge=1, description="Zero gradients on time, in a row, before activation")
    sync_timeout_s: float = Field(120.0, gt=0, description="Restored -> caught up, else rollback")
    activation_tries: int = Field(3, ge=1, description="Proposals without an acknowledgement before rollback")
    grad_timeout_s: float = Field(
        60.0, gt=0, description="ACTIVE: wait for its gradients, then compute its share"
    )
    release_timeout_s: float = Field(
        60.0, gt=0, description="RELEASE sent -> goodbye, else the slot is taken back"
    )
    max_lag_steps: int = Field(32, ge=1, description="Steps a joiner may fall behind before rollback")
