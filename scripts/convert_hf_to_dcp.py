"""The old command: `titanlite convert hf-to-dcp` (titanlite must be installed, as scripts/setup_env.sh does)."""

from titanlite.checkpoint.convert_cli import main_hf_to_dcp

raise SystemExit(main_hf_to_dcp())
