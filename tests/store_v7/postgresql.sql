-- A lease database of schema version 7 (the last before Alembic), as jupyter-gpu-lease
-- 0.1.0 at commit 18207e8 built it on PostgreSQL (pg_dump --schema-only, schema name removed).
CREATE TABLE gpus (
    uuid character varying(128) NOT NULL,
    node character varying(255) NOT NULL,
    name character varying(255) NOT NULL,
    memory_mb bigint NOT NULL,
    idx integer NOT NULL,
    capacity_ppm bigint NOT NULL
);
CREATE TABLE leadership (
    id integer NOT NULL,
    holder character varying(255),
    epoch bigint NOT NULL,
    acquired_at double precision,
    renewed_at double precision,
    expires_at double precision NOT NULL,
    CONSTRAINT ck_leadership_one_row CHECK ((id = 1))
);
CREATE TABLE leases (
    id character varying(64) NOT NULL,
    "user" character varying(255) NOT NULL,
    kernel_id character varying(255) NOT NULL,
    gpu_uuid character varying(128) NOT NULL,
    fraction_ppm bigint NOT NULL,
    memory_limit_mb bigint NOT NULL,
    state character varying(16) NOT NULL,
    grp character varying(255),
    created_at double precision NOT NULL,
    renewed_at double precision NOT NULL,
    expires_at double precision NOT NULL,
    ended_at double precision,
    reason text,
    pid bigint,
    execution_state character varying(32),
    last_activity double precision,
    user_groups text,
    park_state character varying(16),
    parked_at double precision,
    CONSTRAINT ck_leases_ended CHECK ((((state)::text = 'active'::text) OR (ended_at IS NOT NULL))),
    CONSTRAINT ck_leases_fraction CHECK ((fraction_ppm > 0)),
    CONSTRAINT ck_leases_state CHECK (((state)::text = ANY ((ARRAY['active'::character varying, 'revoked'::character varying, 'released'::character varying, 'expired'::character varying])::text[])))
);
CREATE TABLE nodes (
    name character varying(255) NOT NULL,
    gpus text NOT NULL,
    agent_version character varying(64) NOT NULL,
    registered_at double precision NOT NULL,
    drained boolean NOT NULL,
    enforce character varying(8)
);
CREATE TABLE queue_log (
    id character varying(64) NOT NULL,
    "user" character varying(255) NOT NULL,
    kernel_id character varying(255) NOT NULL,
    fraction_ppm bigint NOT NULL,
    grp character varying(255),
    user_groups text NOT NULL,
    arrived_at double precision NOT NULL,
    left_at double precision,
    outcome character varying(16),
    CONSTRAINT ck_queue_log_outcome CHECK (((outcome IS NULL) OR ((outcome)::text = ANY ((ARRAY['granted'::character varying, 'cancelled'::character varying, 'dropped'::character varying])::text[]))))
);
CREATE TABLE quotas (
    level character varying(16) NOT NULL,
    name character varying(255) NOT NULL,
    max_fraction_ppm bigint,
    max_leases integer,
    max_lease_fraction_ppm bigint,
    budget_fraction_hours double precision,
    budget_window_s bigint,
    priority integer,
    CONSTRAINT ck_quotas_level CHECK (((level)::text = ANY ((ARRAY['default'::character varying, 'group'::character varying, 'user'::character varying])::text[])))
);
CREATE TABLE requests (
    id character varying(64) NOT NULL,
    "user" character varying(255) NOT NULL,
    kernel_id character varying(255) NOT NULL,
    fraction_ppm bigint NOT NULL,
    groups text NOT NULL,
    grp character varying(255),
    node character varying(255),
    gpu_uuids text,
    priority integer NOT NULL,
    arrived_at double precision NOT NULL,
    last_polled_at double precision NOT NULL,
    resume_of character varying(64)
);
CREATE TABLE schema_version (
    version integer NOT NULL,
    description character varying(255) NOT NULL,
    applied_at double precision NOT NULL
);
ALTER TABLE ONLY gpus
    ADD CONSTRAINT gpus_pkey PRIMARY KEY (uuid);
ALTER TABLE ONLY leadership
    ADD CONSTRAINT leadership_pkey PRIMARY KEY (id);
ALTER TABLE ONLY leases
    ADD CONSTRAINT leases_pkey PRIMARY KEY (id);
ALTER TABLE ONLY nodes
    ADD CONSTRAINT nodes_pkey PRIMARY KEY (name);
ALTER TABLE ONLY queue_log
    ADD CONSTRAINT queue_log_pkey PRIMARY KEY (id);
ALTER TABLE ONLY quotas
    ADD CONSTRAINT quotas_pkey PRIMARY KEY (level, name);
ALTER TABLE ONLY requests
    ADD CONSTRAINT requests_pkey PRIMARY KEY (id);
ALTER TABLE ONLY schema_version
    ADD CONSTRAINT schema_version_pkey PRIMARY KEY (version);
ALTER TABLE ONLY requests
    ADD CONSTRAINT uq_requests_kernel UNIQUE ("user", kernel_id);
CREATE INDEX ix_leases_active_gpu ON leases USING btree (gpu_uuid) WHERE ((state)::text = 'active'::text);
CREATE INDEX ix_leases_ended ON leases USING btree (ended_at);
CREATE INDEX ix_leases_state ON leases USING btree (state);
CREATE INDEX ix_leases_user ON leases USING btree ("user");
CREATE INDEX ix_queue_log_arrived ON queue_log USING btree (arrived_at);
CREATE UNIQUE INDEX uq_leases_active_kernel ON leases USING btree ("user", kernel_id) WHERE ((state)::text = 'active'::text);
INSERT INTO schema_version (version, description, applied_at) VALUES
    (1, 'initial schema', 1700000000.0),
    (2, 'leases record their user''s groups', 1700000000.0),
    (3, 'the queue''s history', 1700000000.0),
    (4, 'nodes registered by node agents', 1700000000.0),
    (5, 'nodes record their agent''s enforcement mode', 1700000000.0),
    (6, 'fenced leadership of active/standby brokers', 1700000000.0),
    (7, 'parked leases and resume requests', 1700000000.0);
INSERT INTO leadership (id, holder, epoch, expires_at) VALUES (1, NULL, 0, 0.0);
