-- A lease database of schema version 7 (the last before Alembic), as jupyter-gpu-lease
-- 0.1.0 at commit 18207e8 built it on SQLite (sqlite_master's sql, in creation order).
CREATE TABLE schema_version (
	version INTEGER NOT NULL, 
	description VARCHAR(255) NOT NULL, 
	applied_at DOUBLE NOT NULL, 
	PRIMARY KEY (version)
);
CREATE TABLE gpus (
	uuid VARCHAR(128) NOT NULL, 
	node VARCHAR(255) NOT NULL, 
	name VARCHAR(255) NOT NULL, 
	memory_mb BIGINT NOT NULL, 
	idx INTEGER NOT NULL, 
	capacity_ppm BIGINT NOT NULL, 
	PRIMARY KEY (uuid)
);
CREATE TABLE leases (
	id VARCHAR(64) NOT NULL, 
	user VARCHAR(255) NOT NULL, 
	kernel_id VARCHAR(255) NOT NULL, 
	gpu_uuid VARCHAR(128) NOT NULL, 
	fraction_ppm BIGINT NOT NULL, 
	memory_limit_mb BIGINT NOT NULL, 
	state VARCHAR(16) NOT NULL, 
	grp VARCHAR(255), 
	created_at DOUBLE NOT NULL, 
	renewed_at DOUBLE NOT NULL, 
	expires_at DOUBLE NOT NULL, 
	ended_at DOUBLE, 
	reason TEXT, 
	pid BIGINT, 
	execution_state VARCHAR(32), 
	last_activity DOUBLE, user_groups TEXT, park_state VARCHAR(16), parked_at DOUBLE PRECISION, 
	PRIMARY KEY (id), 
	CONSTRAINT ck_leases_state CHECK (state IN ('active', 'revoked', 'released', 'expired')), 
	CONSTRAINT ck_leases_fraction CHECK (fraction_ppm > 0), 
	CONSTRAINT ck_leases_ended CHECK (state = 'active' OR ended_at IS NOT NULL)
);
CREATE INDEX ix_leases_state ON leases (state);
CREATE INDEX ix_leases_user ON leases (user);
CREATE INDEX ix_leases_active_gpu ON leases (gpu_uuid) WHERE state = 'active';
CREATE UNIQUE INDEX uq_leases_active_kernel ON leases ("user", kernel_id) WHERE state = 'active';
CREATE TABLE requests (
	id VARCHAR(64) NOT NULL, 
	user VARCHAR(255) NOT NULL, 
	kernel_id VARCHAR(255) NOT NULL, 
	fraction_ppm BIGINT NOT NULL, 
	groups TEXT NOT NULL, 
	grp VARCHAR(255), 
	node VARCHAR(255), 
	gpu_uuids TEXT, 
	priority INTEGER NOT NULL, 
	arrived_at DOUBLE NOT NULL, 
	last_polled_at DOUBLE NOT NULL, resume_of VARCHAR(64), 
	PRIMARY KEY (id), 
	CONSTRAINT uq_requests_kernel UNIQUE (user, kernel_id)
);
CREATE TABLE quotas (
	level VARCHAR(16) NOT NULL, 
	name VARCHAR(255) NOT NULL, 
	max_fraction_ppm BIGINT, 
	max_leases INTEGER, 
	max_lease_fraction_ppm BIGINT, 
	budget_fraction_hours DOUBLE, 
	budget_window_s BIGINT, 
	priority INTEGER, 
	PRIMARY KEY (level, name), 
	CONSTRAINT ck_quotas_level CHECK (level IN ('default', 'group', 'user'))
);
CREATE TABLE queue_log (
	id VARCHAR(64) NOT NULL, 
	user VARCHAR(255) NOT NULL, 
	kernel_id VARCHAR(255) NOT NULL, 
	fraction_ppm BIGINT NOT NULL, 
	grp VARCHAR(255), 
	user_groups TEXT NOT NULL, 
	arrived_at DOUBLE NOT NULL, 
	left_at DOUBLE, 
	outcome VARCHAR(16), 
	PRIMARY KEY (id), 
	CONSTRAINT ck_queue_log_outcome CHECK (outcome IS NULL OR outcome IN ('granted', 'cancelled', 'dropped'))
);
CREATE INDEX ix_queue_log_arrived ON queue_log (arrived_at);
CREATE INDEX ix_leases_ended ON leases (ended_at);
CREATE TABLE nodes (
	name VARCHAR(255) NOT NULL, 
	gpus TEXT NOT NULL, 
	agent_version VARCHAR(64) NOT NULL, 
	registered_at DOUBLE NOT NULL, 
	drained BOOLEAN NOT NULL, enforce VARCHAR(8), 
	PRIMARY KEY (name)
);
CREATE TABLE leadership (
	id INTEGER NOT NULL, 
	holder VARCHAR(255), 
	epoch BIGINT NOT NULL, 
	acquired_at DOUBLE, 
	renewed_at DOUBLE, 
	expires_at DOUBLE NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT ck_leadership_one_row CHECK (id = 1)
);
INSERT INTO schema_version (version, description, applied_at) VALUES
    (1, 'initial schema', 1700000000.0),
    (2, 'leases record their user''s groups', 1700000000.0),
    (3, 'the queue''s history', 1700000000.0),
    (4, 'nodes registered by node agents', 1700000000.0),
    (5, 'nodes record their agent''s enforcement mode', 1700000000.0),
    (6, 'fenced leadership of active/standby brokers', 1700000000.0),
    (7, 'parked leases and resume requests', 1700000000.0);
INSERT INTO leadership (id, holder, epoch, expires_at) VALUES (1, NULL, 0, 0.0);
