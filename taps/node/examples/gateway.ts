/**
 * A Node gateway hosting the kvcanary tap: an OpenAI-compatible pass-through (chat completions,
 * completions, the Responses API; JSON or streamed) in front of one upstream, which hands the tap
 * every exchange once the caller has its answer. What a real gateway (Portkey's, an Express or
 * Fastify proxy) does at the same place: the request body it parsed, the response body it relayed
 * (a stream's events as it passed them on), who asked, which deployment answered, the times.
 *
 * Environment: the tap's (`KVCANARY_TAP_URL`, `KVCANARY_TAP_TOKEN`, `KVCANARY_TAP_KEY`,
 * `KVCANARY_TAP_GATEWAY`, ...), and the example's own: `GATEWAY_PORT` (a free one by default;
 * the port is printed), `GATEWAY_UPSTREAM` (the deployment's base URL, `http://host:8000/v1`),
 * `GATEWAY_TEAMS` (`key=team,...`: a key the gateway knows is its team's; another is named by
 * its digest).
 */

import { createServer, type IncomingMessage, type ServerResponse } from "node:http";

import { Tap, sseEvents } from "../src/index.js";

const tap = Tap.fromEnv();
const upstream = (process.env.GATEWAY_UPSTREAM ?? "").replace(/\/+$/, "");
const teams = new Map(
  (process.env.GATEWAY_TEAMS ?? "")
    .split(",")
    .filter((pair) => pair.includes("="))
    .map((pair) => pair.split("=", 2) as [string, string]),
);

async function bodyOf(request: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of request) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString("utf8");
}

async function relay(request: IncomingMessage, response: ServerResponse): Promise<void> {
  const started = Date.now() / 1000;
  const text = await bodyOf(request);
  let parsed: unknown = null;
  try {
    parsed = JSON.parse(text);
  } catch {
    // not JSON: relayed as it is, and no exchange of the protocol's
  }
  const key = (request.headers.authorization ?? "").replace(/^Bearer\s+/i, "");
  const path = (request.url ?? "/").replace(/^\/v1/, "");
  const answer = await fetch(`${upstream}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    body: text,
  });
  const streamed = (answer.headers.get("content-type") ?? "").includes("text/event-stream");
  response.writeHead(answer.status, { "content-type": answer.headers.get("content-type") ?? "application/json" });
  let relayed = "";
  let firstByte: number | null = null;
  const decoder = new TextDecoder();
  for await (const chunk of answer.body ?? []) {
    firstByte ??= Date.now() / 1000;
    relayed += decoder.decode(chunk as Uint8Array, { stream: true });
    response.write(chunk);
  }
  relayed += decoder.decode();
  response.end();
  if (parsed === null) return;
  // The caller has its answer: the tap's work starts now, off the request's path.
  const team = teams.get(key);
  let body: unknown = null;
  if (!streamed) {
    try {
      body = JSON.parse(relayed);
    } catch {
      body = null;
    }
  }
  const model = (parsed as { model?: unknown }).model;
  tap.observe({
    request: parsed,
    ...(streamed ? { events: sseEvents(relayed) } : { response: body }),
    started,
    caller: team ?? key,
    callerKind: team ? "team" : "key_hash",
    key,
    apiBase: upstream,
    modelGroup: typeof model === "string" ? model : "",
    status: answer.status,
    latencySeconds: Date.now() / 1000 - started,
    ttftSeconds: firstByte === null ? null : firstByte - started,
  });
}

const server = createServer((request, response) => {
  relay(request, response).catch((error: unknown) => {
    if (!response.headersSent) response.writeHead(502, { "content-type": "application/json" });
    response.end(JSON.stringify({ error: String(error) }));
  });
});

server.listen(Number(process.env.GATEWAY_PORT ?? 0), "127.0.0.1", () => {
  const address = server.address();
  console.log(JSON.stringify({ listening: typeof address === "object" && address ? address.port : null }));
});

async function stop(): Promise<void> {
  server.close();
  // What waits is sent before the gateway goes (the tap's close waits up to 5 s).
  await tap.close();
  console.log(JSON.stringify({ stats: tap.stats() }));
  process.exit(0);
}

process.on("SIGTERM", () => void stop());
process.on("SIGINT", () => void stop());
