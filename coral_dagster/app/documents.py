"""What the commands print and write: JSON documents of plans (finite numbers only), the files they write and
where the project's own files live."""

from coral_dagster.allocation.codec import finite_json as finite_json, plan_to_doc as plan_to_doc
from coral_dagster.files import make_dir as make_dir, write_file as write_file
from coral_dagster.paths import REPO_ROOT as REPO_ROOT
