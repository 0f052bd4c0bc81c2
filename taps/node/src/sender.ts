/**
 * The tap's queue and its HTTP transport (docs/tap-protocol.md, "Transports"): exchanges in,
 * records out to the monitor's `POST /api/v1/traffic` in batches, never a gateway's request
 * waiting on it.
 *
 * `put` only appends. Off the request path (a timer, one exchange a turn of the event loop) each
 * exchange is summarized; records are posted in batches of up to `batchRecords`, or once the
 * oldest has waited `flushSeconds`. A batch keeps its id until the monitor takes it, so a resend
 * after a lost answer is judged once. While the monitor does not take a batch, records wait (at
 * most `maxPending` in all: past it the oldest not being sent are dropped and counted) and the
 * batch is tried again after 0.5, 1, 2, 5 and then every 10 seconds. The drops ride with the next
 * batch the monitor takes (`dropped`, at most 1,000,000 a batch).
 *
 * Answers: 200 taken; 422 taken, its `rejected` records refused for ever (counted as dropped);
 * 400 refused whole for ever (a batch the monitor will never take: a version it does not speak);
 * 413 the body too large: sent again as two batches, ids made by `partId`, the drop report with the
 * first, down to a record alone, which is dropped; anything else, or no answer: tried again.
 */

import { randomBytes } from "node:crypto";

import type { Fingerprinter } from "./fingerprints.js";
import { type Exchange, type TrafficRecord, summarize } from "./record.js";
import { MAX_DROPPED, MAX_RECORDS, batchBody, encode, partId } from "./wire.js";

export const BACKOFF_SECONDS = [0.5, 1, 2, 5, 10] as const;

export interface SenderOptions {
  /** The monitor: `http://host:port`; records go to `/api/v1/traffic`. */
  url: string;
  /** The monitor's ingest token. */
  token: string;
  gateway: string;
  maxPending?: number;
  batchRecords?: number;
  flushSeconds?: number;
  timeoutSeconds?: number;
  /** Told each time records are dropped (the gateway's own counter). */
  onDrop?: (count: number) => void;
  /** Where the tap says what went wrong (default: `console.warn`). */
  log?: (message: string) => void;
}

interface Queued {
  record: TrafficRecord;
  encoded: string;
  at: number;
}

class TooLarge extends Error {}

export class Sender {
  sent = 0;
  dropped = 0;
  rejected = 0;
  private readonly endpoint: string;
  private readonly headers: Record<string, string>;
  private readonly maxPending: number;
  private readonly batchRecords: number;
  private readonly flushMs: number;
  private readonly timeoutMs: number;
  private readonly onDrop: (count: number) => void;
  private readonly log: (message: string) => void;
  private readonly exchanges: Exchange[] = [];
  private readonly records: Queued[] = [];
  private retry: { id: string; count: number; dropped: number } | null = null;
  private unreported = 0;
  private failures = 0;
  private nextTry = 0;
  private tooLarge: number | null = null;
  private timer: NodeJS.Timeout | null = null;
  private running: Promise<void> | null = null;
  private closed = false;

  constructor(
    private readonly fingerprinter: Fingerprinter,
    private readonly options: SenderOptions,
  ) {
    this.endpoint = `${options.url.replace(/\/+$/, "")}/api/v1/traffic`;
    this.headers = { Authorization: `Bearer ${options.token}`, "Content-Type": "application/json" };
    this.maxPending = options.maxPending ?? 10_000;
    this.batchRecords = Math.min(options.batchRecords ?? 200, MAX_RECORDS);
    this.flushMs = (options.flushSeconds ?? 1) * 1000;
    this.timeoutMs = (options.timeoutSeconds ?? 5) * 1000;
    this.onDrop = options.onDrop ?? (() => {});
    this.log = options.log ?? ((message) => console.warn(message));
  }

  /** Exchanges and records held: waiting, or being sent. */
  get pending(): number {
    return this.exchanges.length + this.records.length;
  }

  /** Queue one exchange; past `maxPending`, drop the oldest not being sent. Never throws. */
  put(exchange: Exchange): void {
    if (this.closed) {
      this.drop(1);
      return;
    }
    while (this.pending >= this.maxPending) {
      if (!this.dropOldest()) {
        this.drop(1);
        return;
      }
    }
    this.exchanges.push(exchange);
    this.wake(0);
  }

  /** Send what is queued (for up to `timeoutSeconds`), then stop. */
  async close(timeoutSeconds = 5): Promise<void> {
    this.closed = true;
    const deadline = Date.now() + timeoutSeconds * 1000;
    this.nextTry = 0;
    while (this.pending && Date.now() < deadline) {
      await this.pump();
      if (this.pending) await new Promise((resolve) => setTimeout(resolve, Math.min(100, Math.max(deadline - Date.now(), 0))));
    }
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
  }

  private dropOldest(): boolean {
    const held = this.retry ? this.retry.count : 0;
    if (this.records.length > held) {
      this.records.splice(held, 1);
    } else if (this.exchanges.length) {
      this.exchanges.shift();
    } else {
      return false;
    }
    this.drop(1);
    return true;
  }

  private drop(count: number): void {
    this.dropped += count;
    this.unreported += count;
    this.onDrop(count);
  }

  private wake(ms: number): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = setTimeout(() => void this.pump(), ms);
    this.timer.unref();
  }

  private pump(): Promise<void> {
    this.running ??= this.work().finally(() => {
      this.running = null;
    });
    return this.running;
  }

  private async work(): Promise<void> {
    while (this.exchanges.length) {
      const exchange = this.exchanges.shift()!;
      try {
        const record = summarize(exchange, this.fingerprinter);
        this.records.push({ record, encoded: encode(record), at: Date.now() });
      } catch (error) {
        this.log(`kvcanary tap: cannot summarize an exchange (${String(error)}); dropped`);
        this.drop(1);
      }
      // One exchange a turn: the gateway's own work runs between them.
      await new Promise((resolve) => setImmediate(resolve));
    }
    while (this.due()) {
      if (!(await this.postBatch())) {
        this.nextTry = Date.now() + 1000 * BACKOFF_SECONDS[Math.min(this.failures, BACKOFF_SECONDS.length - 1)]!;
        this.failures++;
        break;
      }
      this.failures = 0;
      this.nextTry = 0;
    }
    if (!this.closed && this.pending) {
      const oldest = this.records[0]?.at ?? Date.now();
      const wait = Math.max(this.nextTry - Date.now(), this.records.length >= this.batchRecords ? 0 : oldest + this.flushMs - Date.now(), 0);
      this.wake(this.exchanges.length ? 0 : wait);
    }
  }

  private due(): boolean {
    if (!this.records.length) return false;
    if (this.closed) return true;
    const now = Date.now();
    if (now < this.nextTry) return false;
    return this.records.length >= this.batchRecords || now - this.records[0]!.at >= this.flushMs;
  }

  /** Send the oldest records; return whether all of them were taken. */
  private async postBatch(): Promise<boolean> {
    this.retry ??= {
      id: randomBytes(16).toString("hex"),
      count: Math.min(this.batchRecords, this.records.length),
      dropped: Math.min(this.unreported, MAX_DROPPED),
    };
    const { id, count, dropped } = this.retry;
    const encoded = this.records.slice(0, count).map((q) => q.encoded);
    const [taken, refused] = await this.sendPart(encoded, 0, count, id, dropped);
    if (!taken) return false;
    this.retry = null;
    this.unreported -= dropped;
    this.records.splice(0, taken);
    this.sent += taken - refused;
    this.rejected += refused;
    if (refused) this.drop(refused);
    return taken === count;
  }

  private async sendPart(encoded: string[], start: number, end: number, id: string, dropped: number): Promise<[number, number]> {
    const body = batchBody(id, this.options.gateway, dropped, encoded.slice(start, end));
    try {
      if (end - start > 1 && this.tooLarge !== null && Buffer.byteLength(body) >= this.tooLarge) throw new TooLarge();
      return await this.post(body, end - start);
    } catch (error) {
      if (!(error instanceof TooLarge)) throw error;
    }
    if (end - start === 1) {
      this.log(`kvcanary tap: the monitor refused a record of ${body.length} bytes as too large (413); dropped`);
      return [1, 1];
    }
    const middle = Math.floor((start + end) / 2);
    const first = await this.sendPart(encoded, start, middle, partId(id, 0), dropped);
    if (first[0] < middle - start) return first;
    const second = await this.sendPart(encoded, middle, end, partId(id, 1), 0);
    return [first[0] + second[0], first[1] + second[1]];
  }

  /** Return [records taken (all or none), refused of those]; throw TooLarge for a 413. */
  private async post(body: string, records: number): Promise<[number, number]> {
    let answer: Response;
    try {
      answer = await fetch(this.endpoint, {
        method: "POST",
        headers: this.headers,
        body,
        // A redirect is a misconfigured URL: following it would carry the token elsewhere.
        redirect: "manual",
        signal: AbortSignal.timeout(this.timeoutMs),
      });
    } catch (error) {
      this.log(`kvcanary tap: cannot reach the monitor (${String(error)}); records wait`);
      return [0, 0];
    }
    const text = await answer.text().catch(() => "");
    if (answer.status === 200) return [records, 0];
    if (answer.status === 422) {
      let refused = records;
      try {
        const found = (JSON.parse(text) as { rejected?: unknown }).rejected;
        if (typeof found === "number" && Number.isInteger(found)) refused = Math.min(Math.max(found, 0), records);
      } catch {
        // an answer that says nothing: every record counts as refused
      }
      this.log(`kvcanary tap: the monitor refused ${refused} record(s) of a batch (422)`);
      return [records, refused];
    }
    if (answer.status === 413) {
      const size = Buffer.byteLength(body);
      if (this.tooLarge === null || size < this.tooLarge) this.tooLarge = size;
      throw new TooLarge();
    }
    if (answer.status === 400) {
      this.log(`kvcanary tap: the monitor refused a batch (400: ${text.slice(0, 300)}); ${records} records dropped`);
      return [records, records];
    }
    this.log(`kvcanary tap: the monitor answered ${answer.status}; records wait`);
    return [0, 0];
  }
}
