"""The old command: `titanlite convert dcp-to-hf` (titanlite must be installed, as scripts/setup_env.sh does)."""

from titanlite.checkpoint.convert_cli import main_dcp_to_hf

raise SystemExit(main_dcp_to_hf())
