/**
 * The tap's sender against a monitor's ingest on a real loopback socket (node:http), scripted
 * where a real monitor cannot misbehave on cue: what each answer does to a batch (docs/tap-protocol.md,
 * "Transports"). The end-to-end test against a real `kvcanary serve` is tests/tap/test_node_tap.py.
 */

import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";

import { Tap } from "../src/index.js";
import { partId } from "../src/wire.js";

type Answer = (body: any, raw: string) => [number, unknown];

interface Monitor {
  url: string;
  bodies: any[];
  sizes: number[];
  answer: Answer;
  close(): Promise<void>;
}

async function monitor(answer: Answer = (body) => [200, { accepted: body.records.length }]): Promise<Monitor> {
  const state: Monitor = { url: "", bodies: [], sizes: [], answer, close: async () => {} };
  const server = createServer((request: IncomingMessage, response: ServerResponse) => {
    const chunks: Buffer[] = [];
    request.on("data", (c: Buffer) => chunks.push(c));
    request.on("end", () => {
      const raw = Buffer.concat(chunks).toString("utf8");
      const body = JSON.parse(raw);
      assert.equal(request.headers.authorization, "Bearer ingest-token");
      state.bodies.push(body);
      state.sizes.push(Buffer.byteLength(raw));
      const [status, json] = state.answer(body, raw);
      response.writeHead(status, { "content-type": "application/json", ...(status === 307 ? { location: "http://elsewhere/" } : {}) });
      response.end(JSON.stringify(json));
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  state.url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  state.close = () => new Promise((resolve) => server.close(() => resolve()));
  return state;
}

function tapFor(url: string, extra = {}): Tap {
  return new Tap(new TextEncoder().encode("a-test-fingerprint-key-0123456789"), {
    url,
    token: "ingest-token",
    gateway: "gw-node",
    flushSeconds: 0.02,
    log: () => {},
    ...extra,
  });
}

function exchange(i: number) {
  return {
    request: { model: "m", messages: [{ role: "user", content: `question ${i} about the parcel` }] },
    response: { id: `chatcmpl-${i}`, choices: [{ message: { content: `answer ${i}` }, finish_reason: "stop" }] },
    caller: `team-${i % 2}`,
    callerKind: "team",
    apiBase: "http://10.0.0.7:8000/v1",
    started: 1767225600 + i,
  };
}

async function until(check: () => boolean, seconds = 10): Promise<void> {
  const deadline = Date.now() + seconds * 1000;
  while (!check()) {
    if (Date.now() > deadline) throw new Error("timed out");
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

test("a batch carries the protocol's version, the gateway, and each record once", async () => {
  const m = await monitor();
  const tap = tapFor(m.url);
  for (let i = 0; i < 5; i++) tap.observe(exchange(i));
  await tap.close();
  await m.close();
  const records = m.bodies.flatMap((b) => b.records);
  assert.equal(records.length, 5);
  assert.deepEqual(new Set(m.bodies.map((b) => b.version)), new Set([4]));
  assert.equal(m.bodies[0].gateway, "gw-node");
  assert.match(m.bodies[0].batch, /^[0-9a-f]{32}$/);
  assert.deepEqual(records.map((r: any) => r.upstream_id), ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2", "chatcmpl-3", "chatcmpl-4"]);
  assert.deepEqual(tap.stats(), { sent: 5, dropped: 0, rejected: 0, pending: 0 });
});

test("a monitor that does not take a batch gets the same batch again, under the same id", async () => {
  let refusals = 2;
  const m = await monitor((body) => (refusals-- > 0 ? [503, { detail: "later" }] : [200, { accepted: body.records.length }]));
  const tap = tapFor(m.url);
  tap.observe(exchange(1));
  await until(() => tap.stats().sent === 1);
  await tap.close();
  await m.close();
  assert.equal(m.bodies.length, 3);
  assert.equal(new Set(m.bodies.map((b) => b.batch)).size, 1);
});

test("a 400 (a version the monitor does not speak) drops the batch and counts it; a redirect is not followed", async () => {
  const m = await monitor(() => [400, { detail: "tap protocol version 4 is not spoken here", versions: [5] }]);
  const tap = tapFor(m.url);
  tap.observe(exchange(1));
  await until(() => tap.stats().dropped === 1);
  assert.equal(tap.stats().rejected, 1);
  m.answer = () => [307, {}];
  tap.observe(exchange(2));
  await until(() => m.bodies.length >= 3);
  assert.equal(tap.stats().sent, 0);
  await tap.close(0.2);
  await m.close();
});

test("a 422 refuses the records it names and takes the rest", async () => {
  const m = await monitor((body) => [422, { detail: [], omitted_errors: 0, accepted: body.records.length - 1, rejected: 1 }]);
  const tap = tapFor(m.url, { batchRecords: 3 });
  for (let i = 0; i < 3; i++) tap.observe(exchange(i));
  await until(() => tap.stats().sent + tap.stats().rejected === 3);
  await tap.close();
  await m.close();
  assert.deepEqual(tap.stats(), { sent: 2, dropped: 1, rejected: 1, pending: 0 });
});

test("a body refused as too large goes again in halves named from its id, and a record alone too large is dropped", async () => {
  const m = await monitor((body, raw) => {
    if (Buffer.byteLength(raw) > 2500 || body.records.some((r: any) => r.upstream_id === "chatcmpl-huge")) return [413, { detail: "too large" }];
    return [200, { accepted: body.records.length }];
  });
  const tap = tapFor(m.url, { batchRecords: 8 });
  const words = Array.from({ length: 600 }, (_, i) => `w${i}`).join(" ");
  for (let i = 0; i < 4; i++) tap.observe(exchange(i));
  tap.observe({ ...exchange(9), response: { id: "chatcmpl-huge", choices: [{ message: { content: words } }] } });
  await until(() => tap.stats().pending === 0);
  await tap.close();
  await m.close();
  const first = m.bodies[0].batch;
  const ids = m.bodies.map((b) => b.batch);
  assert.ok(ids.includes(partId(first, 0)) && ids.includes(partId(first, 1)), "halves named from the batch's id");
  const taken = m.bodies.filter((b, i) => m.sizes[i]! <= 2500 && !b.records.some((r: any) => r.upstream_id === "chatcmpl-huge"));
  assert.equal(taken.flatMap((b) => b.records).length, 4);
  assert.deepEqual(tap.stats(), { sent: 4, dropped: 1, rejected: 1, pending: 0 });
});

test("records past the queue's bound drop the oldest, and the next batch reports them", async () => {
  const m = await monitor(() => [503, {}]);
  const tap = tapFor(m.url, { maxPending: 3 });
  for (let i = 0; i < 6; i++) tap.observe(exchange(i));
  await until(() => m.bodies.length >= 1);
  m.answer = (body) => [200, { accepted: body.records.length }];
  await tap.close(15);
  await m.close();
  assert.equal(tap.stats().dropped, 3);
  assert.equal(m.bodies.at(-1).dropped, 3);
  assert.deepEqual(m.bodies.at(-1).records.map((r: any) => r.upstream_id), ["chatcmpl-3", "chatcmpl-4", "chatcmpl-5"]);
});

test("an environment without the monitor's URL, token or a long enough key is refused, naming the variable", () => {
  assert.throws(() => Tap.fromEnv({}), /KVCANARY_TAP_URL/);
  assert.throws(() => Tap.fromEnv({ KVCANARY_TAP_URL: "nats://n:4222" }), /KVCANARY_TAP_URL/);
  assert.throws(() => Tap.fromEnv({ KVCANARY_TAP_URL: "http://m" }), /KVCANARY_TAP_TOKEN/);
  assert.throws(() => Tap.fromEnv({ KVCANARY_TAP_URL: "http://m", KVCANARY_TAP_TOKEN: "t", KVCANARY_TAP_KEY: "short" }), /KVCANARY_TAP_KEY/);
  assert.throws(
    () => Tap.fromEnv({ KVCANARY_TAP_URL: "http://m", KVCANARY_TAP_TOKEN: "t", KVCANARY_TAP_KEY: "k".repeat(16), KVCANARY_TAP_GATEWAY: "bad name!" }),
    /KVCANARY_TAP_GATEWAY/,
  );
});
