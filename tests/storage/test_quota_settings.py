"""The quota and retention settings: finite defaults, read from FREIGHT_*, bad values refused."""

from __future__ import annotations

import pytest

from storage.settings import Settings, SettingsError


def test_defaults_are_finite_and_read_from_the_environment(tmp_path):
    s = Settings.from_env({}, data_dir=tmp_path)
    assert s.quota_stored_bytes > 0 and s.quota_open_batches > 0 and s.quota_queued_requests > 0
    assert s.file_retention_seconds == 30 * 86400 and s.batch_data_retention_seconds == 86400
    env = {"FREIGHT_QUOTA_OPEN_BATCHES": "3", "FREIGHT_FILE_RETENTION_SECONDS": "0",
           "FREIGHT_SAMPLE_RETENTION_SECONDS": "7200"}  # fmt: skip
    s = Settings.from_env(env, data_dir=tmp_path)
    assert (s.quota_open_batches, s.file_retention_seconds, s.sample_retention_seconds) == (3, 0, 7200)


@pytest.mark.parametrize(
    "env",
    [
        {"FREIGHT_QUOTA_STORED_BYTES": "-1"},
        {"FREIGHT_QUOTA_QUEUED_REQUESTS": "-5"},
        {"FREIGHT_FILE_RETENTION_SECONDS": "-1"},
        {"FREIGHT_CLEANUP_SECONDS": "0"},
        {"FREIGHT_SAMPLE_RETENTION_SECONDS": "60"},  # shorter than the throughput window reads
    ],
)
def test_bad_values_are_refused(tmp_path, env):
    with pytest.raises(SettingsError):
        Settings.from_env(env, data_dir=tmp_path)
