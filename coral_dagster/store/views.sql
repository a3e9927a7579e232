-- Documented views over plan history. Tables: plans (one row per plan), plan_instances (instances per plan).

-- plan_history: every plan in time order, with its instance and node counts; `seq` counts the plans of one
-- scenario's contents (`scenario_key`) and method.
CREATE OR REPLACE VIEW plan_history AS
WITH counted AS (
    SELECT plan_id, coalesce(sum(count), 0) AS instances FROM plan_instances GROUP BY plan_id
)
SELECT p.plan_id, p.run_id, p.created_at, p.scenario, p.scenario_key, p.method, p.status, p.snapshot_id,
       p.cost_usd_per_hour, p.lp_bound_usd_per_hour, p.gap, p.solve_s, p.demand_scale,
       coalesce(c.instances, 0) AS instances,
       row_number() OVER (PARTITION BY p.scenario_key, p.method ORDER BY p.created_at, p.plan_id) AS seq
FROM plans p LEFT JOIN counted c USING (plan_id)
ORDER BY p.created_at, p.plan_id;

-- plan_diff: per plan, how many instances of each (model, phase, region, nodes) it adds or removes
-- relative to the previous plan of the same scenario contents and method.
CREATE OR REPLACE VIEW plan_diff AS
WITH h AS (
    SELECT plan_id, scenario_key, method, seq,
           lag(plan_id) OVER (PARTITION BY scenario_key, method ORDER BY seq) AS prev_plan_id
    FROM plan_history
), cur AS (
    SELECT h.plan_id, h.prev_plan_id, i.model, i.phase, i.region, i.nodes, i.count
    FROM h JOIN plan_instances i ON i.plan_id = h.plan_id
), prev AS (
    SELECT h.plan_id, h.prev_plan_id, i.model, i.phase, i.region, i.nodes, i.count
    FROM h JOIN plan_instances i ON i.plan_id = h.prev_plan_id
)
SELECT coalesce(c.plan_id, p.plan_id) AS plan_id, coalesce(c.prev_plan_id, p.prev_plan_id) AS prev_plan_id,
       coalesce(c.model, p.model) AS model, coalesce(c.phase, p.phase) AS phase,
       coalesce(c.region, p.region) AS region, coalesce(c.nodes, p.nodes) AS nodes,
       coalesce(p.count, 0) AS before, coalesce(c.count, 0) AS after,
       coalesce(c.count, 0) - coalesce(p.count, 0) AS delta
FROM cur c FULL OUTER JOIN prev p
  ON c.plan_id = p.plan_id AND c.model = p.model AND c.phase = p.phase AND c.region = p.region
 AND c.nodes = p.nodes
WHERE coalesce(c.count, 0) <> coalesce(p.count, 0);

-- cost_by_model: $/h each plan spends on each model (all phases and regions).
CREATE OR REPLACE VIEW cost_by_model AS
SELECT plan_id, model, sum(count * usd_per_hour) AS usd_per_hour, sum(count) AS instances
FROM plan_instances
GROUP BY plan_id, model
ORDER BY plan_id, model;

-- plan_expectations: per plan and model, the SLO attainment the plan expects (the closed loop's simulation of it on
-- each model's own trace) and which simulation that was; join `simulations` (newest run per plan) for what it got.
CREATE OR REPLACE VIEW plan_expectations AS
SELECT p.plan_id, p.scenario, p.method, p.created_at, e.key AS model, CAST(e.value AS DOUBLE) AS expected_attainment,
       json_extract_string(p.detail_json, '$.expected_from') AS expected_from
FROM plans p, json_each(p.detail_json, '$.expected_attainment') e;
